"""What a constrained request asks of its output text: a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a grammar (Lark, or GBNF/EBNF as llama.cpp
and SGLang write it).

`StructuredOutput` is a plain, frozen description that travels inside `SamplingParams`; the
engine compiles it with llguidance (`lockstep.engine.grammar`) when the request is added, and
a spec that does not compile is a `RequestError` naming `field` (the request field the client
used, e.g. `response_format.json_schema.schema`), so the server answers 400 with that name.

The constrained token set at each step is a pure function of the spec and the request's own
output tokens; see lockstep/engine/logits_processing.py for where it meets the logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from lockstep.errors import RequestError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")

# Bigger specs are refused before compiling (a client's schema is compiled on the server).
MAX_SPEC_CHARS = 1 << 20


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output text.

    kind: "json_schema" (`spec` is the schema as JSON text), "json_object" (any JSON object;
    `spec` empty), "regex" (`spec` the pattern, matched against the whole output), "choice"
    (`spec` a JSON list of strings: the output is exactly one of them) or "grammar" (`spec` a
    Lark grammar, llguidance's dialect, which may embed a JSON schema as `%json {...}`; GBNF
    as llama.cpp and SGLang's `ebnf` write it is converted).
    field: the request field that carried it, for error messages."""

    kind: Kind
    spec: str = ""
    field: str = "structured_output"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"{self.field}: kind={self.kind!r} is invalid: expected one of "
                               f"{', '.join(KINDS)}")  # fmt: skip
        if not isinstance(self.spec, str):
            raise RequestError(f"{self.field}={self.spec!r} is invalid: expected text")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise RequestError(f"{self.field} has {len(self.spec)} characters: at most "
                               f"{MAX_SPEC_CHARS}")  # fmt: skip
        if self.kind != "json_object" and not self.spec:
            raise RequestError(f"{self.field} is empty: expected a {self.kind}")

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | bool, field: str = "json_schema"
    ) -> StructuredOutput:
        """Output that is one JSON value valid against `schema` (a dict, or True for any)."""
        if schema is True:
            return cls("json_object", "", field)
        if not isinstance(schema, dict):
            raise RequestError(f"{field}={schema!r} is invalid: expected a JSON schema object")
        return cls("json_schema", json.dumps(schema), field)

    @classmethod
    def json_object(cls, field: str = "response_format") -> StructuredOutput:
        """Output that is any one JSON object."""
        return cls("json_object", "", field)

    @classmethod
    def regex(cls, pattern: str, field: str = "regex") -> StructuredOutput:
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, choices: list[str], field: str = "choice") -> StructuredOutput:
        """Output that is exactly one of `choices` (non-empty strings)."""
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise RequestError(f"{field}={choices!r} is invalid: expected a non-empty list of "
                               "non-empty strings")  # fmt: skip
        return cls("choice", json.dumps(choices), field)

    @classmethod
    def grammar(cls, text: str, field: str = "grammar") -> StructuredOutput:
        """Output that the grammar `text` (Lark, or GBNF/EBNF) derives from its start rule."""
        return cls("grammar", text, field)
