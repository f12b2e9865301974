"""docs/server.md's request-field table against the code, so that neither can drift: every
field the request models declare is a `supported` row of its route, every entry of the
unsupported-field tables a `neutral only` row whose value that table accepts, and every row
one of the two."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from lockstep.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
)
from lockstep.server.unsupported_fields import UNSUPPORTED_FIELDS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "server.md"
HEADER = "| field | route | status | how, or why not |"
ROUTES = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
# Rows named `prefix...` describe the fields of a nested object: (its model, its table).
NESTED = {
    "stream_options.": (StreamOptions, "stream_options"),
    "messages[].": (ChatMessage, "messages"),
}


def _rows() -> list[tuple[str, str, str]]:
    """(field, route, status) for every row of the table."""
    table = DOCS.read_text().split(HEADER, 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.strip().splitlines()[1:]:  # after the |---| line
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) >= 4, line
        field = re.fullmatch(r"`([a-z_\[\].]+)`", cells[0])
        assert field, f"the field cell is one `name`: {line}"
        assert cells[1] in ("both", *ROUTES), line
        assert cells[2] == "supported" or cells[2].startswith("neutral only: `"), line
        assert cells[3], f"no explanation: {line}"
        rows.append((field.group(1), cells[1], cells[2]))
    return rows


def _documented(rows: list, route: str, prefix: str = "") -> dict[str, set[str]]:
    """The documented names per status for `route` (or for nested fields under `prefix`)."""
    out: dict[str, set[str]] = {"supported": set(), "neutral": set()}
    for field, row_route, status in rows:
        if row_route not in ("both", route):
            continue
        nested = next((p for p in NESTED if field.startswith(p)), "")
        if nested != prefix:
            continue
        kind = "supported" if status == "supported" else "neutral"
        out[kind].add(field[len(prefix) :])
    return out


def _declared(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)


def test_each_field_has_one_row_per_route() -> None:
    seen: dict[tuple[str, str], int] = {}
    for field, route, _ in _rows():
        for r in ROUTES if route == "both" else (route,):
            seen[(field, r)] = seen.get((field, r), 0) + 1
    assert [key for key, count in seen.items() if count > 1] == []


@pytest.mark.parametrize("route", list(ROUTES))
def test_table_matches_the_request_models(route: str) -> None:
    rows = _rows()
    documented = _documented(rows, route)
    assert documented["supported"] == _declared(ROUTES[route])
    assert documented["neutral"] == set(UNSUPPORTED_FIELDS[route])


@pytest.mark.parametrize("prefix", list(NESTED))
def test_table_matches_the_nested_models(prefix: str) -> None:
    model, table = NESTED[prefix]
    routes = ["chat"] if prefix == "messages[]." else list(ROUTES)
    for route in routes:
        documented = _documented(_rows(), route, prefix)
        assert documented["supported"] == _declared(model), route
        assert documented["neutral"] == set(UNSUPPORTED_FIELDS[table]), route


def test_documented_neutral_values_are_the_accepted_ones() -> None:
    """The value a `neutral only` row shows passes that field's neutral test, and a
    different value does not (the control: the test is not `accept anything`)."""
    for field, route, status in _rows():
        if status == "supported":
            continue
        value = json.loads(status.removeprefix("neutral only: `").removesuffix("`"))
        prefix = next((p for p in NESTED if field.startswith(p)), "")
        tables = [NESTED[prefix][1]] if prefix else (list(ROUTES) if route == "both" else [route])
        for table in tables:
            neutral = UNSUPPORTED_FIELDS[table][field[len(prefix) :]]
            assert neutral(value), (field, value)
            assert not neutral("something else"), field
