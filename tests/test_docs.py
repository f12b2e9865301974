"""What the docs tell users to type exists: the pip extras they name are extras of
pyproject.toml, and the model their client examples ask for is the name the server serves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"  # lockstep.models.resolver.DEFAULT_MODEL_NAME
PLACEHOLDERS = {"NAME"}


def test_every_pip_extra_the_docs_name_exists() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    named = {
        (doc.name, extra)
        for doc in DOCS
        for group in re.findall(r"lockstep\[([a-z0-9_,-]+)\]", doc.read_text())
        for extra in group.split(",")
    }
    assert named, "the docs name no extra at all: the pattern no longer matches"
    assert {(doc, extra) for doc, extra in named if extra not in extras} == set()


def test_client_examples_ask_for_the_served_name() -> None:
    from lockstep.models.resolver import DEFAULT_MODEL_NAME

    assert DEFAULT_MODEL_NAME == DEFAULT_SERVED_NAME
    asked = {
        (doc.name, name)
        for doc in DOCS
        for name in re.findall(r'model="([^"]+)"|"model": "([^"]+)"', doc.read_text())
        for name in name
        if name
    }
    assert asked
    wrong = {(doc, name) for doc, name in asked if name not in {DEFAULT_SERVED_NAME, *PLACEHOLDERS}}
    assert wrong == set()
