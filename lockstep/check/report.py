"""Output of `lockstep check`: a rich table for people, JSON for machines, and a plot of
|delta logprob| by position (matplotlib, Agg backend, so it works without a display)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lockstep.check.compare import FAIL, PASS
from lockstep.check.runner import CheckReport

_STYLE = {PASS: "bold green", FAIL: "bold red"}


def _fmt_delta(x: float) -> str:
    if x == 0:
        return "0"
    return "inf" if math.isinf(x) else f"{x:.3g}"


def render_table(report: CheckReport, console: Console) -> None:
    """Print one row per scenario, then the notes and an overall verdict."""
    engine = report.engine_info or {}
    title = f"lockstep check: {report.model} at {report.url}"
    if engine.get("mode"):
        title += f" (mode {engine['mode']})"
    table = Table(title=title, title_justify="left")
    # Short headers so that the table fits 80 columns; docs/check.md spells them out.
    for col, justify in (
        ("scenario", "left"),
        ("reqs", "right"),
        ("positions", "right"),
        ("flips", "right"),
        ("1st div", "right"),
        ("max|Δlp|", "right"),
        ("cached", "right"),
        ("result", "left"),
    ):
        table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in report.results:
        table.add_row(
            r.name,
            str(r.requests),
            str(r.positions),
            str(r.flips),
            "-" if r.first_divergence is None else str(r.first_divergence),
            _fmt_delta(r.max_abs_delta),
            str(r.cached_tokens),
            f"[{_STYLE.get(r.status, 'yellow')}]{r.status}[/]",
        )
    console.print(table)
    # Reasons and notes are sentences: below the table they stay readable at 80 columns.
    for r in report.results:
        if r.reason:
            style = _STYLE.get(r.status, "yellow")
            console.print(f"[{style}]{r.name} {r.status}[/]: {r.reason}", highlight=False)
        for note in r.notes:
            console.print(f"  [dim]{r.name}:[/] {note}", highlight=False)
    if report.engine_counters:
        moved = ", ".join(f"{k} +{v:g}" for k, v in report.engine_counters.items())
        console.print(f"engine counters during the check: {moved}", highlight=False)
    tol = "exact" if report.settings.atol == 0 else f"atol {report.settings.atol:g}"
    verdict = "[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]"
    console.print(
        f"{verdict} ({tol} comparison, {report.elapsed_s:.1f} s of a {report.budget_s:g} s budget)"
    )


def write_json(report: CheckReport, path: Path) -> None:
    path.write_text(json.dumps(report.to_json(), indent=1, allow_nan=False) + "\n")


def write_plot(report: CheckReport, path: Path) -> None:
    """|delta logprob| by position, the largest over all compared runs, one line per scenario.
    A symmetric-log axis keeps exact zeros visible next to tiny and large differences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    plotted, largest = 0, 0.0
    for r in report.results:
        if not r.max_delta_by_position:
            continue
        xs = sorted(r.max_delta_by_position)
        # inf (a logprob missing on one side) is drawn at the top of the axis as 1e3.
        ys = [min(r.max_delta_by_position[x], 1e3) for x in xs]
        ax.plot(xs, ys, marker="o", markersize=3, label=f"{r.name} ({r.status})")
        plotted += 1
        largest = max(largest, *ys)
    ax.set_yscale("symlog", linthresh=1e-9)
    ax.set_ylim(0, max(1e-3, 10 * largest))
    ax.set_xlabel("position in the completion")
    ax.set_ylabel("max |Δ logprob|")
    ax.set_title(f"lockstep check: {report.model} ({'PASS' if report.passed else 'FAIL'})")
    if plotted:
        ax.legend(loc="upper left", fontsize="small")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
