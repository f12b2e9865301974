"""What the docs tell users to type exists: the model their client examples ask for is the name
the server serves (their commands and `pip install` lines: test_doc_examples.py)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"  # lockstep.models.resolver.DEFAULT_MODEL_NAME
PLACEHOLDERS = {"NAME"}


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


# A measured figure: a number with a rate unit, or a dated measurement (docs/map.md, "Figures").
FIGURE = re.compile(
    r"\d[\d,.]*\s*(?:k\s*)?(?:tok/s|tokens/s|ms/token|ms/step|[KMGT]B/s|[GT]FLOP/s)"
    r"|\b20\d\d-\d\d-\d\d\b"
)


def figures(text: str) -> list[str]:
    return [m.group(0) for m in FIGURE.finditer(text)]


def test_measured_figures_live_in_results_md_only() -> None:
    """Every measured figure is in docs/results.md beside its command; the other docs point
    there (STYLE.md: a figure lives once). The control: results.md itself is full of them."""
    assert len(figures((REPO / "docs" / "results.md").read_text())) > 50
    assert figures("4.69 ms/token, 31.8k tok/s, 4.28 TB/s, 2026-12-02") == [
        "4.69 ms/token", "31.8k tok/s", "4.28 TB/s", "2026-12-02",
    ]  # fmt: skip
    found = {
        (doc.name, figure)
        for doc in DOCS
        if doc.name != "results.md"
        for figure in figures(doc.read_text())
    }
    assert found == set()


def test_gpu_md_is_a_reference() -> None:
    """docs/gpu.md holds the kernels, how each keeps the contract and the defaults (at most 300
    lines); measurements are in docs/results.md."""
    assert len((REPO / "docs" / "gpu.md").read_text().splitlines()) <= 300
