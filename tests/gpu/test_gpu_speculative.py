"""Exact speculative decoding on the GPU (docs/speculative.md): bfloat16, Triton kernels, CUDA
graphs on (decode steps and verify steps of the same rows per sequence replay graphs, other
verify steps piecewise graphs).

Runs only where CUDA is present; CI has no GPU, where tests/contract/test_speculative.py runs
the same comparisons on the CPU. Each timing test prints one JSON line (`SPECULATIVE_GPU ...`)
for docs/results.md. Run:

    python -m pytest -q -s tests/gpu/test_gpu_speculative.py
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[2]
COPY_PROMPTS = REPO / "bench" / "copy_prompts.jsonl"


def _engine(model: str | None, mode: str = "deterministic", **options):
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    config = dict(model=model, mode=mode, device="cuda", dtype="bfloat16", kv_tokens=32768,
                  max_model_len=4096, max_running=64, debug_checks=False)  # fmt: skip
    return Engine(EngineConfig(**(config | options)))


def _run(engine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return {
        rid: ([t for o in got for t in o.new_token_ids],
              [lp for o in got for lp in (o.new_logprobs or o.new_token_logprobs)],
              got[-1].finish_reason)
        for rid, got in outs.items()
    }  # fmt: skip


def _copy_requests(engine, max_tokens: int) -> dict:
    from lockstep.bench.speculative import load_prompts
    from lockstep.engine.sampling_params import SamplingParams

    prompts = load_prompts(COPY_PROMPTS, engine)
    return {
        p.name: (p.token_ids, SamplingParams(max_tokens=max_tokens, temperature=i % 2 * 0.8,
                                             seed=i, logprobs=2))
        for i, p in enumerate(prompts)
    }  # fmt: skip


class _FixedDrafter:
    """Always proposes `limit` copies of one token: every step is a verify step of k rows
    (almost always rejected), for timing."""

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        return [tokens[-1]] * limit


def test_speculation_with_cuda_graphs_equals_plain_decode() -> None:
    """Copy prompts (greedy and seeded, top logprobs) beside random-token batch-mates, on the
    embedded model: every output equals the plain engine's, CUDA graphs on in both."""
    from lockstep.engine.sampling_params import SamplingParams

    plain = _engine(None)
    requests = _copy_requests(plain, 96)
    rng = random.Random(0)
    for i in range(16):
        prompt = [rng.randrange(1000, 30000) for _ in range(rng.randint(5, 300))]
        requests[f"mate{i}"] = (prompt, SamplingParams(max_tokens=48, temperature=1.0, seed=i,
                                                       ignore_eos=True))  # fmt: skip
    want = _run(plain, requests)
    assert plain.runner.graphs is not None
    del plain
    spec = _engine(None, speculative="ngram", num_draft_tokens=4)
    got = _run(spec, requests)
    counters = spec.speculator.counters
    assert counters.accepted > 0, counters
    for rid in requests:
        assert got[rid] == want[rid], rid
    spec.check_integrity()


class _OracleDrafter:
    """Proposes what the plain engine generated after each prompt: every draft is kept."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        for prompt, out in self.continuations.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                return out[done : done + limit]
        return []


@pytest.mark.parametrize("model", ["random:qwen3-0.6b", "random:tiny-qwen3-moe"])
@pytest.mark.parametrize("drafter", ["oracle", "wrong"])
def test_verify_graphs_equal_plain_decode(model: str, drafter: str) -> None:
    """Eight requests (greedy and seeded, top logprobs) whose every step verifies drafts of
    one length (a drafter always right, or always wrong): verify steps replay whole-step
    graphs (some keyed by Q > 1 are captured), and every output equals the plain engine's."""
    from lockstep.engine.sampling_params import SamplingParams

    rng = random.Random(2)
    requests = {
        f"r{i}": ([rng.randrange(1000, 30000) for _ in range(rng.randint(20, 400))],
                  SamplingParams(max_tokens=40, temperature=i % 2 * 0.8, seed=i, logprobs=2,
                                 ignore_eos=True))
        for i in range(8)
    }  # fmt: skip
    plain = _engine(model)
    want = _run(plain, requests)
    del plain
    spec = _engine(model, speculative="ngram", num_draft_tokens=4, verify_cuda_graphs=True)
    if drafter == "oracle":
        spec.speculator.drafter = _OracleDrafter(
            {tuple(p): want[rid][0] for rid, (p, _) in requests.items()}
        )
    else:
        spec.speculator.drafter = _FixedDrafter()
    got = _run(spec, requests)
    assert any(q > 1 for _, _, q in spec.runner.graphs._graphs), list(spec.runner.graphs._graphs)
    if drafter == "oracle":
        assert spec.speculator.counters.accepted > 0
    for rid in requests:
        assert got[rid] == want[rid], rid
    spec.check_integrity()


def test_negative_control_reference_mode_speculation_differs() -> None:
    plain = _engine(None, mode="reference")
    requests = _copy_requests(plain, 64)
    want = _run(plain, requests)
    del plain
    spec = _engine(None, mode="reference", speculative="ngram", num_draft_tokens=4)
    got = _run(spec, requests)
    assert spec.speculator.counters.accepted > 0
    assert any(got[r][1] != want[r][1] for r in requests), "reference mode gave the same bits"


def _step_times(engine, prompt: list[int], steps: int) -> list[float]:
    """Wall time of each of `steps` steps after the prefill, batch 1 (each step ends with its
    tokens on the host)."""
    from lockstep.engine.sampling_params import SamplingParams

    engine.add_request("t", prompt, SamplingParams(max_tokens=10 * steps, temperature=0.0,
                                                   ignore_eos=True))  # fmt: skip
    engine.step()  # the prefill
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    engine.abort_request("t")
    engine.flush_cache()
    return times


@pytest.mark.parametrize("model", ["random:qwen3-8b", None])
def test_verify_step_of_four_drafts_against_a_decode_step(model: str | None) -> None:
    """Batch 1, 512-token context: a verify step of k = 4 (5 rows, a verify graph) against a
    one-token decode step (CUDA graph), printed for docs/results.md (a benchmark: speed is measured
    here, never asserted)."""
    rng = random.Random(1)
    prompt = [rng.randrange(1000, 30000) for _ in range(512)]
    plain = _engine(model)
    _step_times(plain, prompt, 8)  # warm-up: kernels, graphs
    decode = statistics.median(_step_times(plain, prompt, 64))
    del plain
    spec = _engine(model, speculative="ngram", num_draft_tokens=4)
    spec.speculator.drafter = _FixedDrafter()
    _step_times(spec, prompt, 8)
    verify = statistics.median(_step_times(spec, prompt, 64))
    figures = {"model": model or "SmolLM2-135M-Instruct (embedded)", "context": 512,
               "decode_ms": 1000 * decode, "verify_k4_ms": 1000 * verify,
               "ratio": verify / decode, "device": torch.cuda.get_device_name()}  # fmt: skip
    print("SPECULATIVE_GPU " + json.dumps(figures))


def test_ngram_speedup_on_copy_prompts() -> None:
    """The embedded model, batch 1, greedy, the copy prompts: identical outputs; the decode
    speed-up is printed for docs/results.md (measured, never asserted)."""
    from lockstep.bench.speculative import bench_speculative, load_prompts, report

    plain = _engine(None)
    spec = _engine(None, speculative="ngram", num_draft_tokens=4)
    prompts = load_prompts(COPY_PROMPTS, plain)
    bench_speculative(plain, spec, prompts[:1], 16, 1)  # warm-up: kernels, graphs
    results = bench_speculative(plain, spec, prompts, 128, 3)
    doc = report(results, {"model": None, "device": "cuda", "num_draft_tokens": 4}, 3)
    doc["device"] = torch.cuda.get_device_name()
    print("SPECULATIVE_GPU " + json.dumps(doc))
    assert doc["identical"]


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
def test_hybrid_speculation_with_cuda_graphs_equals_plain_decode(kernel: str) -> None:
    """Tiny Qwen3.5 on the pooled Triton Gated DeltaNet kernels, CUDA graphs on: verify
    chunks whose drafts are right up to a moving point (every count of kept drafts, so
    `LinearState.end_verify` cuts the pooled state back mid-chunk), beside batch-mates and
    past chunk boundaries: every output equals plain decode's."""
    from tests.contract.test_speculative_hybrid import (
        _check_verify_chunks_stay_in_one_rule_chunk,
        _PartlyRightDrafter,
        _requests,
    )

    options = {"gdn_kernel": kernel, "max_model_len": 512, "kv_tokens": 8192}
    plain = _engine("random:tiny-qwen3.5", **options)
    vocab = plain.decoder.spec.vocab_size
    requests = _requests(11, vocab, 24, 80)
    want = _run(plain, requests)
    spec = _engine("random:tiny-qwen3.5", speculative="ngram", prompt_lookup_min=1, **options)
    spec.speculator.drafter = _PartlyRightDrafter(
        [requests[r][0] + want[r][0] for r in requests], vocab, wrong=False
    )
    widest = _check_verify_chunks_stay_in_one_rule_chunk(spec)
    got = _run(spec, requests)
    counters = spec.speculator.counters
    assert max(widest) == 4 and 0 < counters.accepted < counters.drafted, counters
    assert counters.boundary_limited > 0, counters
    for rid in requests:
        assert got[rid] == want[rid], rid


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_mtp_speculation_on_cuda_equals_plain_decode(tmp_path: Path, family: str) -> None:
    """A tiny folder with an MTP layer (tests/support/tiny_hf.py) on CUDA, bfloat16: the MTP
    layer drafts (decode steps then run eagerly: the runner keeps hidden rows), and every
    output equals the plain engine's, which replays CUDA graphs."""
    from tests.contract.test_speculative_hybrid import _requests
    from tests.support.tiny_hf import add_mtp_layer, save_tiny

    save_tiny(family, tmp_path)
    add_mtp_layer(tmp_path)
    plain = _engine(str(tmp_path), max_model_len=256, kv_tokens=8192)
    requests = _requests(12, plain.decoder.spec.vocab_size, 16, 48)
    want = _run(plain, requests)
    spec = _engine(str(tmp_path), max_model_len=256, kv_tokens=8192, speculative="mtp")
    got = _run(spec, requests)
    assert spec.speculator.counters.drafted > 0
    for rid in requests:
        assert got[rid] == want[rid], rid
