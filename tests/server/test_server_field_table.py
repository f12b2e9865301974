"""docs/server.md's request-field tables against the code, so that neither can drift. For the
OpenAI routes and for `/generate` alike: every field the request models declare is a
`supported` or an `accepted` row (`accepted` exactly where its description says "accepted:"),
every entry of the unsupported-field tables a `neutral only` row whose value that table
accepts, every row one of these, and every row names its source."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from lockstep.server.native_protocol import (
    UNSUPPORTED_GENERATE,
    UNSUPPORTED_SAMPLING,
    GenerateRequest,
    NativeSamplingParams,
)
from lockstep.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
)
from lockstep.server.unsupported_fields import UNSUPPORTED_FIELDS, Neutral

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"
OPENAI_HEADER = "| field | source | route | status | what Lockstep does |"
GENERATE_HEADER = "| field | source | status | what Lockstep does |"
ROUTES = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
# Rows named `prefix...` describe the fields of a nested object: (its model, its table).
NESTED = {
    "stream_options.": (StreamOptions, UNSUPPORTED_FIELDS["stream_options"]),
    "messages[].": (ChatMessage, UNSUPPORTED_FIELDS["messages"]),
}
GENERATE_PARTS = {
    "": (GenerateRequest, UNSUPPORTED_GENERATE),
    "sampling_params.": (NativeSamplingParams, UNSUPPORTED_SAMPLING),
}
SOURCES = re.compile(
    r"(OpenAI|SGLang|SGLang 0\.5\.23|SGLang \(older\)|vLLM|Lockstep|sglang-router)"
    r"(, (OpenAI|SGLang|vLLM))*"
)


def _table(header: str) -> list[list[str]]:
    """The cells of every row of the table under `header`, each row checked for shape."""
    table = DOCS.read_text().split(header, 1)[1].split("\n\n", 1)[0]
    width = header.count("|") - 1
    rows = []
    for line in table.strip().splitlines()[1:]:  # after the |---| line
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) >= width, line
        assert re.fullmatch(r"`([a-z0-9_\[\].]+)`", cells[0]), (
            f"the field cell is one `name`: {line}"
        )
        assert SOURCES.fullmatch(cells[1]), f"the source cell names the APIs: {line}"
        status = cells[width - 2]
        assert status in ("supported", "accepted") or status.startswith("neutral only: `"), line
        assert cells[width - 1], f"no explanation: {line}"
        rows.append([cells[0].strip("`"), *cells[1:width]])
    return rows


def _openai_rows() -> list[tuple[str, str, str]]:
    """(field, route, status) of the OpenAI routes' table."""
    rows = []
    for field, _, route, status, _ in _table(OPENAI_HEADER):
        assert route in ("both", *ROUTES), (field, route)
        rows.append((field, route, status))
    return rows


def _generate_rows() -> list[tuple[str, str]]:
    """(field, status) of the `/generate` table."""
    return [(field, status) for field, _, status, _ in _table(GENERATE_HEADER)]


def _kind(status: str) -> str:
    return "neutral" if status.startswith("neutral only") else status


def _classes(rows: list[tuple[str, str]], prefixes: list[str], prefix: str) -> dict[str, set]:
    """The documented names per class among `rows` (field, status) directly under `prefix`."""
    out: dict[str, set[str]] = {"supported": set(), "accepted": set(), "neutral": set()}
    for field, status in rows:
        nested = next((p for p in prefixes if p and field.startswith(p)), "")
        if nested == prefix:
            out[_kind(status)].add(field[len(prefix) :])
    return out


def _declared(model: type[BaseModel]) -> dict[str, set[str]]:
    """The model's fields: those it only accepts (description "accepted: ...") and the rest."""
    accepted = {
        name
        for name, info in model.model_fields.items()
        if re.search(r"\baccepted:", info.description or "")
    }
    return {"supported": set(model.model_fields) - accepted, "accepted": accepted}


def _for_route(route: str) -> list[tuple[str, str]]:
    return [(f, s) for f, r, s in _openai_rows() if r in ("both", route)]


def test_each_field_has_one_row_per_route() -> None:
    seen: dict[tuple[str, str], int] = {}
    for field, route, _ in _openai_rows():
        for r in ROUTES if route == "both" else (route,):
            seen[(field, r)] = seen.get((field, r), 0) + 1
    for field, _ in _generate_rows():
        seen[(field, "generate")] = seen.get((field, "generate"), 0) + 1
    assert [key for key, count in seen.items() if count > 1] == []


@pytest.mark.parametrize("route", list(ROUTES))
def test_table_matches_the_request_models(route: str) -> None:
    documented = _classes(_for_route(route), list(NESTED), "")
    declared = _declared(ROUTES[route])
    assert documented["supported"] == declared["supported"]
    assert documented["accepted"] == declared["accepted"]
    assert documented["neutral"] == set(UNSUPPORTED_FIELDS[route])


@pytest.mark.parametrize("prefix", list(NESTED))
def test_table_matches_the_nested_models(prefix: str) -> None:
    model, table = NESTED[prefix]
    routes = ["chat"] if prefix == "messages[]." else list(ROUTES)
    for route in routes:
        documented = _classes(_for_route(route), list(NESTED), prefix)
        assert documented["supported"] | documented["accepted"] == set(model.model_fields)
        assert documented["neutral"] == set(table), route


@pytest.mark.parametrize("prefix", list(GENERATE_PARTS))
def test_generate_table_matches_the_native_models(prefix: str) -> None:
    model, table = GENERATE_PARTS[prefix]
    documented = _classes(_generate_rows(), list(GENERATE_PARTS), prefix)
    declared = _declared(model)
    assert documented["supported"] == declared["supported"]
    assert documented["accepted"] == declared["accepted"]
    assert documented["neutral"] == set(table)


def _check_neutral(neutral: Neutral, field: str, status: str) -> None:
    value = json.loads(status.removeprefix("neutral only: `").removesuffix("`"))
    assert neutral(value), (field, value)
    assert not neutral("something else"), field


def test_documented_neutral_values_are_the_accepted_ones() -> None:
    """The value a `neutral only` row shows passes that field's neutral test, and a
    different value does not (the control: the test is not `accept anything`)."""
    for field, route, status in _openai_rows():
        if _kind(status) != "neutral":
            continue
        prefix = next((p for p in NESTED if field.startswith(p)), "")
        tables = (
            [NESTED[prefix][1]]
            if prefix
            else [UNSUPPORTED_FIELDS[r] for r in (ROUTES if route == "both" else [route])]
        )
        for table in tables:
            _check_neutral(table[field[len(prefix) :]], field, status)
    for field, status in _generate_rows():
        if _kind(status) != "neutral":
            continue
        prefix = "sampling_params." if field.startswith("sampling_params.") else ""
        _check_neutral(GENERATE_PARTS[prefix][1][field[len(prefix) :]], field, status)
