"""Request fields that process the logits: penalties, `min_tokens`, `logit_bias`,
`bad_words` and structured outputs (OpenAI's `response_format`, vLLM's `guided_*` and
`structured_outputs`, SGLang's `regex` / `json_schema` / `ebnf`, on /generate and on the
OpenAI routes), and their translation into
`SamplingParams` keyword arguments (lockstep/engine/logits_processing.py applies them).

A request carries at most one structured-output constraint; a second is a 400 naming it. A
constraint is compiled here, on a worker thread, before the request reaches the engine, so a
schema or grammar that does not compile is a 400 naming the field that carried it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from lockstep.engine.structured_output import StructuredOutput
from lockstep.errors import RequestError
from lockstep.server.protocol import APIError, ProcessingFields, clip


def _schema(value: str | dict[str, Any], field: str) -> StructuredOutput:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise APIError(f"{field} is not valid JSON: {exc}", param=field,
                           code="invalid_value") from None  # fmt: skip
    try:
        return StructuredOutput.json_schema(value, field)
    except RequestError as exc:
        raise APIError(str(exc), param=field, code="invalid_value") from None


def _structured(body: ProcessingFields) -> StructuredOutput | None:
    """The request's one structured-output constraint, or None."""
    found: list[StructuredOutput] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(StructuredOutput.json_object("response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError("response_format of type json_schema needs json_schema.schema",
                           param="response_format.json_schema", code="missing")  # fmt: skip
        found.append(_schema(fmt.json_schema.schema_, "response_format.json_schema.schema"))
    elif fmt is not None and fmt.json_schema is not None:
        raise APIError("response_format.json_schema needs type json_schema",
                       param="response_format.json_schema", code="invalid_value")  # fmt: skip
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            found.append(_schema(so.json_, "structured_outputs.json"))
        if so.regex is not None:
            found.append(_guard(StructuredOutput.regex, so.regex, "structured_outputs.regex"))
        if so.choice is not None:
            found.append(_guard(StructuredOutput.choice, so.choice, "structured_outputs.choice"))
        if so.grammar is not None:
            found.append(_guard(StructuredOutput.grammar, so.grammar, "structured_outputs.grammar"))
        if so.json_object:
            found.append(StructuredOutput.json_object("structured_outputs.json_object"))
    if body.guided_json is not None:
        found.append(_schema(body.guided_json, "guided_json"))
    if body.guided_regex is not None:
        found.append(_guard(StructuredOutput.regex, body.guided_regex, "guided_regex"))
    if body.guided_choice is not None:
        found.append(_guard(StructuredOutput.choice, body.guided_choice, "guided_choice"))
    if body.guided_grammar is not None:
        found.append(_guard(StructuredOutput.grammar, body.guided_grammar, "guided_grammar"))
    # SGLang's names on its OpenAI routes (json_schema on completions only, as in SGLang).
    if body.regex is not None:
        found.append(_guard(StructuredOutput.regex, body.regex, "regex"))
    if body.ebnf is not None:
        found.append(_guard(StructuredOutput.grammar, body.ebnf, "ebnf"))
    json_schema = getattr(body, "json_schema", None)
    if json_schema is not None:
        found.append(_schema(json_schema, "json_schema"))
    return _one(found)


def _guard(make: Any, value: Any, field: str) -> StructuredOutput:
    try:
        return make(value, field)
    except RequestError as exc:
        raise APIError(str(exc), param=field, code="invalid_value") from None


def _one(found: list[StructuredOutput]) -> StructuredOutput | None:
    if len(found) > 1:
        raise APIError(
            f"{found[1].field} and {found[0].field} are both output constraints: send one",
            param=found[1].field,
            code="invalid_value",
        )
    return found[0] if found else None


def logit_bias_pairs(
    bias: dict[str, float] | None, vocab_size: int, param: str = "logit_bias"
) -> tuple:
    """OpenAI's logit_bias (token id as a string -> bias) as (id, bias) pairs, checked;
    `param` names the field in errors."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isascii() or not key.isdigit() or int(key) >= vocab_size:
            raise APIError(
                f"{param}: key {clip(repr(key))} is not a token id: expected an integer"
                f" 0..{vocab_size - 1} written as a string",
                param=param,
                code="invalid_value",
            )
        if not -100.0 <= value <= 100.0:
            raise APIError(f"{param}[{key!r}]={value!r} is out of range: expected a number "
                           "in [-100, 100]", param=param, code="invalid_value")  # fmt: skip
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def processing_options(body: ProcessingFields, vocab_size: int) -> dict[str, Any]:
    """SamplingParams keyword arguments for the body's logits-processing fields."""
    return {
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "min_tokens": body.min_tokens,
        "logit_bias": logit_bias_pairs(body.logit_bias, vocab_size),
        "bad_words": tuple(body.bad_words or ()),
        "structured_output": _structured(body),
    }


def native_processing_options(
    params: Any, vocab_size: int, field: str = "sampling_params"
) -> dict[str, Any]:
    """SamplingParams keyword arguments for SGLang's `sampling_params` penalties,
    `min_new_tokens`, `logit_bias` and `regex` / `json_schema` / `ebnf` (at most one)."""
    found = []
    if params.regex is not None:
        found.append(_guard(StructuredOutput.regex, params.regex, f"{field}.regex"))
    if params.json_schema is not None:
        found.append(_schema(params.json_schema, f"{field}.json_schema"))
    if params.ebnf is not None:
        found.append(_guard(StructuredOutput.grammar, params.ebnf, f"{field}.ebnf"))
    return {
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "min_tokens": params.min_new_tokens,
        "logit_bias": logit_bias_pairs(params.logit_bias, vocab_size, f"{field}.logit_bias"),
        "structured_output": _one(found),
    }


async def compile_constraint(grammars: Any, spec: StructuredOutput | None) -> None:
    """Compile `spec` on a worker thread (the engine then finds it in the compiler's cache);
    a spec that does not compile is a 400 naming its field."""
    if spec is None or grammars is None:
        return
    try:
        await asyncio.to_thread(grammars.grammar, spec)
    except RequestError as exc:
        raise APIError(str(exc), param=spec.field, code="invalid_value") from None
