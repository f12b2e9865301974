"""Overlapped decode (`EngineConfig.overlap_decode`): the next pure-decode step is launched
before the current step's tokens reach the host, its pending rows patched from the device.

The requirement: every request's tokens, logprobs, text and finish reason are those of the
engine without overlap, whatever happens around it (arrivals mid-run, aborts, stop tokens, stop
strings, max_tokens, seeded sampling, top logprobs, prompt logprobs, a KV pool tight enough to
evict and preempt). Runs on CPU, where launching is computing, so it checks the bookkeeping
(pending tokens, slots, the radix cache, integrity after every step); the GPU test in
tests/gpu/test_gpu_engine.py runs the same comparison with CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.engine.structured_output import StructuredOutput

MODEL = "random:tiny"
GRAMMAR = StructuredOutput.regex("[a-z]{1,30}( [0-9]{1,4})?")


def _engine(overlap: bool, **options) -> Engine:
    options.setdefault("kv_tokens", 4096)
    return Engine(EngineConfig(model=MODEL, device="cpu", dtype="float32", debug_checks=True,
                               overlap_decode=overlap, **options))  # fmt: skip


def _workload(seed: int, vocab: int) -> list[tuple[int, str, list[int], SamplingParams, int]]:
    """(arrival step, id, prompt, params, abort step or -1): shared prompt stems, mixed
    sampling parameters, stop tokens that fire early, penalties and grammars, a few aborts."""
    rng = random.Random(seed)
    stems = [[rng.randrange(vocab) for _ in range(rng.randint(4, 30))] for _ in range(3)]
    work = []
    for i in range(14):
        prompt = rng.choice(stems)[: rng.randint(1, 30)] + [
            rng.randrange(vocab) for _ in range(rng.randint(1, 10))
        ]
        kind = i % 5
        params = SamplingParams(
            max_tokens=rng.randint(1, 40),
            temperature=0.0 if kind in (0, 1) else rng.choice([0.7, 1.0]),
            seed=1000 + i,
            ignore_eos=True,
            stop_token_ids=[rng.randrange(vocab) for _ in range(40)] if kind == 1 else [],
            logprobs=2 if kind == 2 else None,
            prompt_logprobs=1 if kind == 3 else None,
            stop=["e"] if kind == 4 else [],
        )
        if i % 3 == 0:  # logits processing: chosen after the host has the previous token
            params = dataclasses.replace(
                params, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3,
                logit_bias={7: 5.0}, min_tokens=min(3, params.max_tokens),
            )  # fmt: skip
        if i % 4 == 2:
            params = dataclasses.replace(params, structured_output=GRAMMAR)
        abort = rng.randint(2, 12) if i % 7 == 3 else -1
        work.append((rng.randint(0, 10), f"r{i}", prompt, params, abort))
    return work


def _drive(engine: Engine, work) -> dict[str, tuple]:
    """Add each request at its arrival step and abort at its abort step; collect outputs."""
    outs: dict[str, list] = {rid: [] for _, rid, _, _, _ in work}
    step = 0
    pending = sorted(work, key=lambda w: w[0])
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for _, rid, _, _, abort in work:
            if abort == step and rid in engine.requests:
                engine.abort_request(rid)
        for o in engine.step():
            outs[o.request_id].append(o)
        step += 1
    engine.check_integrity()
    assert engine.stats()["kv_in_use"] == 0
    return {
        rid: (
            [t for o in os_ for t in o.new_token_ids],
            [lp for o in os_ for lp in o.new_token_logprobs],
            [(e.token_id, e.logprob, e.top) for o in os_ for e in (o.new_logprobs or [])],
            [None if e is None else (e.token_id, e.logprob) for e in (os_[0].prompt_logprobs or [])]
            if os_
            else [],
            "".join(o.new_text for o in os_),
            os_[-1].finish_reason if os_ else None,
        )
        for rid, os_ in outs.items()
    }


def assert_same_outputs(got: dict, want: dict, work) -> None:
    """Every request's outputs agree; aborted ones on every token both runs produced."""
    got, want = dict(got), dict(want)
    aborted = {rid for _, rid, _, _, abort in work if abort >= 0}
    for rid in aborted:
        # An abort lands after however many steps the request had run by then, which depends
        # on when it was admitted (a step launched ahead admits arrivals one step later), and
        # it may even finish first in one run: the runs agree on every token both produced.
        a, b = got.pop(rid), want.pop(rid)
        n = min(len(a[0]), len(b[0]))
        assert a[0][:n] == b[0][:n] and a[1][:n] == b[1][:n], rid
        if a[3] and b[3]:
            assert a[3] == b[3], rid
        if a[5] is not None and b[5] is not None:
            assert a[5] == b[5], rid
    assert aborted and got == want


@pytest.mark.parametrize(
    ("seed", "kv_tokens"), [(0, 4096), (1, 4096), (3, 4096), (2, 120), (4, 120)]
)
def test_overlapped_decode_gives_the_outputs_of_the_plain_loop(seed: int, kv_tokens: int) -> None:
    plain = _engine(False, kv_tokens=kv_tokens, max_running=6, output_reserve=0.0)
    vocab = plain.decoder.spec.vocab_size
    work = _workload(seed, vocab)
    want = _drive(plain, work)
    overlapped = _engine(True, kv_tokens=kv_tokens, max_running=6, output_reserve=0.0)
    assert_same_outputs(_drive(overlapped, work), want, work)
    # Not blind: steps were launched ahead, requests stopped early on stop tokens / strings.
    assert overlapped.steps_launched_ahead > 0 and plain.steps_launched_ahead == 0
    reasons = [v[5] for v in want.values()]
    assert "stop" in reasons and "length" in reasons
    if kv_tokens < 1000:  # the tight pool preempted in both runs
        assert plain.scheduler.num_preemptions > 0 and overlapped.scheduler.num_preemptions > 0


def test_processed_requests_are_chosen_after_their_previous_token(monkeypatch) -> None:
    """Steps launched ahead for requests with penalties and grammars make their choice only
    after the host has the previous token (`ModelRunner.sample`, deferred): the outputs of the
    plain loop, with such deferred choices made."""
    from lockstep.engine.model_runner import ModelRunner

    work = [
        (0, f"r{i}", [5 + i, 6, 7], SamplingParams(
            max_tokens=30, temperature=0.0 if i % 2 else 1.0, seed=i, presence_penalty=1.5,
            repetition_penalty=1.2, min_tokens=4,
            structured_output=GRAMMAR if i % 3 == 0 else None, ignore_eos=True,
        ), 6 if i == 5 else -1)
        for i in range(6)
    ]  # fmt: skip
    want = _drive(_engine(False), work)
    deferred = []
    launch = ModelRunner.launch

    def recording(self: ModelRunner, plan, after=None, defer_processing=False):
        step = launch(self, plan, after, defer_processing)
        deferred.append(bool(step.sampling) and step.tokens is None)
        return step

    monkeypatch.setattr(ModelRunner, "launch", recording)
    overlapped = _engine(True)
    assert_same_outputs(_drive(overlapped, work), want, work)
    assert overlapped.steps_launched_ahead > 0 and any(deferred)


def test_negative_control_wrong_pending_tokens_change_outputs(monkeypatch) -> None:
    """If the patch took another row's token, outputs would change: the comparison above
    sees the patched tokens (a shifted source index breaks it)."""
    from lockstep.engine.model_runner import LaunchedStep, TokenSource

    plain = _engine(False)
    vocab = plain.decoder.spec.vocab_size
    work = [(0, f"r{i}", [i + 1, i + 2, i + 3], SamplingParams(max_tokens=12, temperature=0,
             ignore_eos=True), -1) for i in range(3)]  # fmt: skip
    want = _drive(plain, work)

    def shifted(launched: LaunchedStep) -> TokenSource:
        n = len(launched.sampling)
        index = {id(r): (i + 1) % n for i, (r, _) in enumerate(launched.sampling)}
        return TokenSource(launched.tokens, index)

    monkeypatch.setattr(LaunchedStep, "token_source", shifted)
    got = _drive(_engine(True), work)
    assert got != want
    assert vocab > 3


def test_steps_with_prompt_chunks_and_admissions_are_launched_ahead(monkeypatch) -> None:
    """Requests arriving while others decode, prompts cut into chunks of 8: steps launched
    ahead carry prompt chunks and admit waiting requests, and every output is the plain
    loop's (hybrid models launch only pure decode steps ahead: tests/contract/test_hybrid.py)."""
    from lockstep.engine.model_runner import ModelRunner, StepShape

    plain = _engine(False, chunk_size=8, max_running=5)
    work = _workload(7, plain.decoder.spec.vocab_size)
    want = _drive(plain, work)
    ahead_shapes = []
    seen: set[str] = set()
    launch = ModelRunner.launch

    def recording(self: ModelRunner, plan, after=None, defer_processing=False):
        step = launch(self, plan, after, defer_processing)
        first = {c.request.request_id for c in plan} - seen  # admitted in this step
        seen.update(first)
        if after is not None:
            ahead_shapes.append((StepShape.of(step.layout), bool(first)))
        return step

    monkeypatch.setattr(ModelRunner, "launch", recording)
    overlapped = _engine(True, chunk_size=8, max_running=5)
    assert_same_outputs(_drive(overlapped, work), want, work)
    assert any(shape.prefill_rows and shape.decode_rows for shape, _ in ahead_shapes)
    assert any(admitted for _, admitted in ahead_shapes)


def test_no_step_is_launched_past_max_tokens() -> None:
    """A request of max_tokens k needs k - 1 decode steps after its prefill; all of them are
    launched ahead and none more (a step past its last token would be computed for nothing)."""
    engine = _engine(True)
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert len(tokens) == 9 and engine.steps_launched_ahead == 8


def test_a_request_ending_on_max_tokens_does_not_stop_the_others_launching_ahead() -> None:
    """Requests of max_tokens 5 and 9 decode together: the step in which the first ends is
    launched ahead as well (its extra row is discarded), so all 8 decode steps of the second
    are; tokens and logprobs are those of the plain loop."""
    work = [(0, name, [3, 4, 5 + i], SamplingParams(max_tokens=k, temperature=0,
             ignore_eos=True), -1) for i, (name, k) in enumerate((("a", 5), ("b", 9)))]  # fmt: skip
    want = _drive(_engine(False), work)
    engine = _engine(True)
    assert _drive(engine, work) == want
    assert engine.steps_launched_ahead == 8


def test_no_step_is_launched_ahead_when_the_pool_would_preempt() -> None:
    """Two requests in a pool too small for both to finish: a schedule must preempt one, and a
    step launched ahead must never be that schedule (its pending token would be lost; the
    scheduler asserts). Outputs equal the plain loop's."""
    work = [(0, f"r{i}", [7 + i] * 10, SamplingParams(max_tokens=30, temperature=0,
             ignore_eos=True), -1) for i in range(2)]  # fmt: skip
    plain = _engine(False, kv_tokens=60, enable_prefix_cache=False, output_reserve=0.0)
    want = _drive(plain, work)
    overlapped = _engine(True, kv_tokens=60, enable_prefix_cache=False, output_reserve=0.0)
    assert _drive(overlapped, work) == want
    assert overlapped.scheduler.num_preemptions > 0 and overlapped.steps_launched_ahead > 0


def test_default_is_on_for_cuda_and_off_on_the_cpu() -> None:
    """`overlap_decode=None` (the default) resolves by device; an explicit value wins; the CLI
    gives --overlap-decode / --no-overlap-decode and leaves the default when neither is given."""
    import argparse

    from lockstep.cli_options import add_engine_arguments, engine_options_from_args
    from lockstep.errors import ConfigError

    assert EngineConfig().overlap_decode is None
    assert EngineConfig(device="cuda").use_overlap_decode
    assert not EngineConfig(device="cpu").use_overlap_decode
    assert not EngineConfig(device="cuda", overlap_decode=False).use_overlap_decode
    assert EngineConfig(device="cpu", overlap_decode=True).use_overlap_decode
    with pytest.raises(ConfigError, match="overlap_decode='yes'"):
        EngineConfig(overlap_decode="yes")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for argv, want in (([], None), (["--overlap-decode"], True), (["--no-overlap-decode"], False)):
        assert engine_options_from_args(parser.parse_args(argv))["overlap_decode"] is want
