"""The decode benchmark times only steps in which every request of the batch decodes: prompts
prefilled in several chunks (staggered first tokens) must neither shrink the batch inside the
window nor leave requests behind, with or without overlapped decode (a step launched ahead is
in flight when the requests are aborted)."""

from __future__ import annotations

import pytest

from lockstep.bench.decode import run_decode_bench
from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.errors import ConfigError


def _engine(overlap: bool = False, kv_tokens: int = 2048) -> Engine:
    # 4 prompts of 40 tokens through a 64-token step budget: prefills span several steps.
    return Engine(EngineConfig(model="random:tiny", device="cpu", kv_tokens=kv_tokens,
                               max_batch_tokens=64, chunk_size=64, max_running=4,
                               overlap_decode=overlap))  # fmt: skip


def _counting(engine: Engine) -> list[int]:
    sizes: list[int] = []
    real_step = engine.step

    def counting_step():
        outs = real_step()
        sizes.append(len(outs))
        return outs

    engine.step = counting_step
    return sizes


@pytest.mark.parametrize("overlap", [False, True])
def test_window_holds_the_whole_batch_and_cleans_up(overlap: bool) -> None:
    engine = _engine(overlap)
    sizes = _counting(engine)
    r = run_decode_bench(engine, batch=4, prompt_len=40, gen_len=6)
    assert r.decode_ms_per_step > 0 and r.decode_tok_s > 0 and r.prefill_tok_s > 0
    assert not engine.has_unfinished() and not engine.requests
    # Prefill staggered over several steps; the first step with all 4 starts the window,
    # then exactly 6 timed steps with all 4 decoding, then the aborts end the run.
    first_full = sizes.index(4)
    assert first_full >= 2
    assert sizes[first_full:] == [4] * 7
    assert (engine.steps_launched_ahead > 0) == overlap


def test_negative_control_a_shrinking_batch_is_refused() -> None:
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
    decode together (the window would never start): refused up front."""
    with pytest.raises(ConfigError, match="raise --kv-tokens"):
        run_decode_bench(_engine(kv_tokens=150), batch=4, prompt_len=40, gen_len=6)
    with pytest.raises(ConfigError, match="gen_len=0"):
        run_decode_bench(_engine(), batch=4, prompt_len=40, gen_len=0)


def test_sampled_benchmark_samples_with_seeded_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's sampling settings reach the sampler for every request, each with its
    own seed (the control is the greedy default, whose rows have temperature 0); the CLI's
    flags are tested in tests/unit/cli/test_cli.py."""
    from lockstep.engine import model_runner

    seen = []
    real = model_runner.choose_token_tensor

    def spy(logits, rows):
        seen.extend(rows)
        return real(logits, rows)

    monkeypatch.setattr(model_runner, "choose_token_tensor", spy)
    run_decode_bench(_engine(), batch=4, prompt_len=40, gen_len=3)
    assert seen and all(r.temperature == 0.0 for r in seen)
    seen.clear()
    sampling = {"temperature": 1.0, "top_p": 0.9}
    run_decode_bench(_engine(), batch=4, prompt_len=40, gen_len=3, sampling=sampling)
    assert seen and all(r.temperature == 1.0 and r.top_p == 0.9 for r in seen)
    assert {r.seed for r in seen} == {0, 1, 2, 3}


def test_filters_without_a_temperature_are_refused() -> None:
    """--top-p / --top-k at temperature 0 would silently run greedy while the JSON records
    the filters: refused with one line instead."""
    for sampling in ({"top_p": 0.9}, {"top_k": 5}):
        with pytest.raises(ConfigError, match="--temperature"):
            run_decode_bench(_engine(), batch=4, prompt_len=40, gen_len=3, sampling=sampling)
