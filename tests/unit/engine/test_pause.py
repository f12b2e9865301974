"""The engine's side of `/pause_generation` (lockstep/server/engine_loop.py): the step launched
ahead is completed (`Engine.complete_launched_step`), then running requests are retracted to
the queue (`Engine.retract_running`) or kept in place; resumed, every request gives the
tokens and logprobs of a run never paused, bit for bit (control: other seeds differ), and the
pools are whole at every point."""

from __future__ import annotations

import pytest

from lockstep import SamplingParams
from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[(5 * i + 7 * j) % 200 + 3 for j in range(6 + 3 * i)] for i in range(6)]


def _engine() -> Engine:
    config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", kv_tokens=2048,
                          overlap_decode=True, debug_checks=True)  # fmt: skip
    return Engine(config)


def _run(engine: Engine, seed: int, pause: str | None = None) -> dict[str, tuple]:
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed + i, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list] = {f"r{i}": [] for i in range(len(PROMPTS))}

    def collect(outputs: list) -> None:
        for out in outputs:
            tokens[out.request_id].extend(
                zip(out.new_token_ids, out.new_token_logprobs, strict=True)
            )

    steps = 0
    while engine.has_unfinished():
        collect(engine.step())
        steps += 1
        if pause is not None and steps == 6:
            assert engine._inflight is not None  # a step launched ahead: the case to handle
            collect(engine.complete_launched_step())
            assert engine._inflight is None
            assert all(r.pending == 0 for r in engine.requests.values())
            if pause == "retract":
                assert engine.retract_running() > 0
                assert not engine.scheduler.running and engine.scheduler.in_use == 0
            engine.check_integrity()
    engine.check_integrity()
    return {rid: tuple(v) for rid, v in tokens.items()}


@pytest.mark.parametrize("pause", ["retract", "in_place"])
def test_a_paused_run_gives_the_unpaused_bits(pause: str) -> None:
    engine = _engine()
    unpaused = _run(engine, seed=100)
    engine.flush_cache()
    assert _run(engine, seed=100, pause=pause) == unpaused
    assert _run(engine, seed=200) != unpaused  # the control
    assert all(len(v) == 16 for v in unpaused.values())
