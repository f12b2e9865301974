"""The decode benchmark times only steps in which every request of the batch decodes: prompts
prefilled in several chunks (staggered first tokens) must neither shrink the batch inside the
window nor leave requests behind."""

from __future__ import annotations

import pytest

from lockstep.bench.decode import run_decode_bench
from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine


def _engine() -> Engine:
    # 4 prompts of 40 tokens through a 64-token step budget: prefills span several steps.
    return Engine(EngineConfig(model="random:tiny", device="cpu", kv_tokens=2048,
                               max_batch_tokens=64, chunk_size=64, max_running=4))  # fmt: skip


def test_window_holds_the_whole_batch_and_cleans_up() -> None:
    engine = _engine()
    steps = []
    real_step = engine.step

    def counting_step():
        outs = real_step()
        steps.append(len(outs))
        return outs

    engine.step = counting_step
    r = run_decode_bench(engine, batch=4, prompt_len=40, gen_len=6)
    assert r.decode_ms_per_step > 0 and r.decode_tok_s > 0 and r.prefill_tok_s > 0
    assert not engine.has_unfinished() and not engine.requests
    # Prefill staggered over several steps, then at least 6 steps with all 4 decoding.
    first_full = steps.index(4)
    assert first_full >= 2 and steps[first_full : first_full + 7] == [4] * 7


def test_negative_control_a_shrinking_batch_is_refused(monkeypatch) -> None:
    """If a request dropped out inside the window, the figure would be a mix of batch sizes:
    the benchmark must refuse it rather than report it."""
    engine = _engine()
    real_step = engine.step
    calls = []

    def dropping_step():
        outs = real_step()
        calls.append(1)
        return outs[:-1] if len(calls) > 8 and len(outs) == 4 else outs

    engine.step = dropping_step
    with pytest.raises(AssertionError, match="shrank inside the timed window"):
        run_decode_bench(engine, batch=4, prompt_len=40, gen_len=6)


def test_a_pool_too_small_for_the_batch_is_a_clear_error() -> None:
    """Requests that cannot all hold their KV at once would be preempted in turn and never
    decode together: refused up front instead of looping."""
    engine = Engine(EngineConfig(model="random:tiny", device="cpu", kv_tokens=200,
                                 max_batch_tokens=64, chunk_size=64, max_running=4))  # fmt: skip
    with pytest.raises(ValueError, match="raise --kv-tokens"):
        run_decode_bench(engine, batch=4, prompt_len=40, gen_len=6)
