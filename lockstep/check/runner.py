"""Run the selected scenarios against one server within a time budget.

The budget is shared out as the run goes: each scenario gets an equal part of what is left
when it starts, so a quick scenario leaves more time to the ones after it. A scenario whose
turn comes after the budget is spent is skipped with that reason; a scenario that runs out
part-way stops after its current unit and says so (see `ScenarioContext.units`).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lockstep.check.client import CheckClient, RequestRefused, ServerFault
from lockstep.check.compare import FAIL, ScenarioResult
from lockstep.check.scenarios import SCENARIOS, ScenarioContext, ScenarioSettings

logger = logging.getLogger(__name__)


class CheckSetupError(Exception):
    """The server cannot be checked at all (unreachable, no model)."""


@dataclass
class CheckReport:
    """Everything one `lockstep check` run found."""

    url: str
    model: str
    engine_info: dict[str, Any] | None
    settings: ScenarioSettings
    budget_s: float
    elapsed_s: float
    results: list[ScenarioResult]
    # Engine counters' increase over the check (Lockstep's /v1/engine stats); empty elsewhere.
    engine_counters: dict[str, int | float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.status != FAIL for r in self.results)

    def to_json(self) -> dict[str, Any]:
        settings = {
            k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.settings).items()
        }
        return {
            "passed": self.passed,
            "url": self.url,
            "model": self.model,
            "engine": self.engine_info,
            "settings": settings,
            "budget_s": self.budget_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "engine_counters": self.engine_counters,
            "scenarios": [r.to_json() for r in self.results],
        }


async def run_checks(
    url: str,
    scenarios: list[str],
    settings: ScenarioSettings,
    *,
    model: str | None = None,
    budget_s: float = 120.0,
    request_timeout_s: float = 300.0,
    api_key: str | None = None,
    extra_body: dict[str, Any] | None = None,
    api: str = "openai",
    show_progress: bool = True,
    console: Console | None = None,
) -> CheckReport:
    """Run `scenarios` (names from SCENARIOS, run in SCENARIOS order) against the server."""
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(
            f"unknown scenario {unknown[0]!r}: expected some of {', '.join(SCENARIOS)}"
        )
    start = time.monotonic()
    ordered = [name for name in SCENARIOS if name in scenarios]
    async with CheckClient(
        url,
        concurrency=settings.concurrency,
        timeout_s=request_timeout_s,
        api_key=api_key,
        extra_body=extra_body,
        api=api,
    ) as client:
        model, card = await _pick_model(client, model)
        engine_info = await _engine_info(client)
        results: list[ScenarioResult] = []
        # The budget is for the scenarios: it starts once the server has said what it serves.
        deadline = time.monotonic() + budget_s
        progress = Progress(
            TextColumn("{task.description:<9}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=True,
            disable=not show_progress,
        )
        with progress:
            for i, name in enumerate(ordered):
                result = ScenarioResult(name)
                results.append(result)
                left = deadline - time.monotonic()
                if left <= 0:
                    result.skip("time budget spent before this scenario started (--budget-s)")
                    continue
                task = progress.add_task(name, total=None)
                ctx = ScenarioContext(
                    client=client,
                    model=model,
                    settings=settings,
                    # Seeded per scenario: selecting scenarios does not change their prompts.
                    rng=random.Random(f"{settings.seed}:{name}"),
                    deadline=time.monotonic() + left / (len(ordered) - i),
                    engine_info=engine_info if isinstance(engine_info, dict) else None,
                    model_card=card,
                    set_total=lambda n, t=task: progress.update(t, total=n),
                    advance=lambda t=task: progress.advance(t),
                )
                sent_before, t0 = client.requests_sent, time.monotonic()
                try:
                    await SCENARIOS[name](ctx, result)
                except ServerFault as e:
                    result.fail(f"server fault: {e}")
                except RequestRefused as e:
                    result.fail(f"request refused: {e}")
                except Exception as e:  # one odd server answer must not end the whole run
                    logger.exception("scenario %s", name)
                    result.fail(f"unexpected error: {type(e).__name__}: {e}")
                result.finish(settings.atol)
                result.requests = client.requests_sent - sent_before
                result.elapsed_s = time.monotonic() - t0
                progress.remove_task(task)
        counters = _counter_deltas(engine_info, await _engine_info(client))
    return CheckReport(
        url=client.base_url,
        model=model,
        engine_info=engine_info,
        settings=settings,
        budget_s=budget_s,
        elapsed_s=time.monotonic() - start,
        results=results,
        engine_counters=counters,
    )


async def _engine_info(client: CheckClient) -> dict[str, Any] | None:
    """GET /v1/engine where the server has it (Lockstep); None elsewhere or if it fails."""
    try:
        info = await client.get_optional("/v1/engine")
    except (ServerFault, RequestRefused):
        return None
    return info if isinstance(info, dict) else None


def _counter_deltas(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> dict[str, int | float]:
    """How the engine's counters (`stats` keys `*_total` and `num_preemptions`) moved during
    the check: says, e.g., whether preemption or the prefix cache were exercised at all."""
    old, new = (before or {}).get("stats") or {}, (after or {}).get("stats") or {}
    return {
        k: new[k] - old[k]
        for k in sorted(new)
        # kv_total is the pool's size, not a counter.
        if (k == "num_preemptions" or (k.endswith("_total") and not k.startswith("kv_")))
        and isinstance(new[k], (int, float))
        and isinstance(old.get(k), (int, float))
    }


async def _pick_model(client: CheckClient, model: str | None) -> tuple[str, dict[str, Any] | None]:
    """The model to check (the first one /v1/models lists when none is named) and its card."""
    try:
        cards = await client.models()
    except (ServerFault, RequestRefused) as e:
        if model is None:
            raise CheckSetupError(
                f"cannot list models at {client.base_url}/v1/models ({e}): pass --model"
            ) from e
        return model, None
    if model is None:
        if not cards:
            raise CheckSetupError(f"{client.base_url}/v1/models lists no model: pass --model")
        return str(cards[0]["id"]), cards[0]
    card = next((c for c in cards if c.get("id") == model), None)
    return model, card
