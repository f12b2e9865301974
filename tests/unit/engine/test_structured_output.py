"""Structured outputs through the engine (llguidance, lockstep/engine/grammar.py) on
random:tiny, a random model whose unconstrained output is noise: JSON schemas, json_object,
regexes, choices and grammars, greedy and sampled, always give text that parses and
validates, and the request ends when the value is complete. The control: the same requests
without the constraint do not."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from lockstep.engine.llm import LLM
from lockstep.engine.sampling_params import SamplingParams
from lockstep.engine.structured_output import StructuredOutput
from lockstep.errors import RequestError

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "member"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            },
        },
        "required": ["color", "tags", "point"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4},
]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]
SAMPLING = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("random:tiny", device="cpu", dtype="float32", kv_tokens=4096)


def _generate(llm: LLM, spec: StructuredOutput | None, **kw: object) -> list:
    params = [
        SamplingParams(**{"max_tokens": 96, "structured_output": spec, **s, **kw}) for s in SAMPLING
    ]
    prompts = [p for p in PROMPTS for _ in params]
    return llm.generate(prompts, params * len(PROMPTS), use_tqdm=False)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_outputs_parse_and_validate(llm: LLM, index: int) -> None:
    schema = SCHEMAS[index]
    validator = jsonschema_rs.validator_for(schema)
    outs = _generate(llm, StructuredOutput.json_schema(schema))
    for out in outs:
        assert out.finish_reason == "stop", out
        assert validator.is_valid(json.loads(out.text)), out.text
    assert len({o.text for o in outs}) > 1  # sampled rows differ: the mask is not one path
    if index == 0:  # control: the random model alone writes no such JSON
        assert not any(_valid_json(o.text, validator) for o in _generate(llm, None))


def _valid_json(text: str, validator: jsonschema_rs.Validator) -> bool:
    try:
        return validator.is_valid(json.loads(text))
    except ValueError:
        return False


def test_json_object_regex_choice_and_grammars(llm: LLM) -> None:
    for out in _generate(llm, StructuredOutput.json_object(), max_tokens=40):
        # A random model's object may be cut by max_tokens; a complete one parses.
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{")
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for out in _generate(llm, StructuredOutput.regex(pattern)):
        assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out.text
    words = ["yes", "no", "maybe so"]
    for out in _generate(llm, StructuredOutput.choice(words)):
        assert out.text in words and out.finish_reason == "stop"
    lark = 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,2}/'
    gbnf = 'root ::= "<" [ab]{2,5} ">"'
    for spec, full in ((lark, r"x=[0-9]{1,2}(,[0-9]{1,2})*"), (gbnf, r"<[ab]{2,5}>")):
        for out in _generate(llm, StructuredOutput.grammar(spec), max_tokens=48):
            if out.finish_reason == "stop":
                assert re.fullmatch(full, out.text), out.text
            else:  # cut by max_tokens while the grammar could go on
                assert len(out.token_ids) == 48


def test_constrained_logprobs_are_the_raw_ones(llm: LLM) -> None:
    """Logprobs are those of the raw logits (before the mask): scoring the output agrees."""
    spec = StructuredOutput.json_schema(SCHEMAS[0])
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=96, temperature=1.0, seed=5,
                                                    logprobs=0, structured_output=spec),
                       use_tqdm=False)[0]  # fmt: skip
    scored = llm.score([PROMPTS[0] + out.token_ids], use_tqdm=False)[0]
    assert scored.logprobs[len(PROMPTS[0]) :] == out.logprobs


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutput.regex("[a-", field="guided_regex"), "guided_regex"),
        (StructuredOutput.grammar("start: undefined_rule", field="ebnf"), "ebnf"),
        (StructuredOutput("json_schema", '{"type": 5}', field="guided_json"), "guided_json"),
    ],
)
def test_specs_that_do_not_compile_are_refused_by_name(
    llm: LLM, spec: StructuredOutput, words: str
) -> None:
    with pytest.raises(RequestError, match=words):
        llm.generate([PROMPTS[0]], SamplingParams(structured_output=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_spec_shapes_are_checked() -> None:
    with pytest.raises(RequestError, match="guided_choice"):
        StructuredOutput.choice([], field="guided_choice")
    with pytest.raises(RequestError, match="kind"):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(RequestError, match="json_schema"):
        StructuredOutput.json_schema(["not", "a", "schema"])  # type: ignore[arg-type]
