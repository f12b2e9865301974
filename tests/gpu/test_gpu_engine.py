"""The property suite on the GPU (bfloat16, Triton kernels), with real model shapes.

Runs only where CUDA is present (the GPU machine); CI has no GPU, where the same properties
run on the CPU path (test_position_invariance.py) and the Triton kernels run under the
interpreter (test_ops_triton.py). The negative control requires reference mode (cuBLAS, SDPA) to
break batch invariance on the same harness.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from tests.support.invariance_harness import Plan, compute, mismatches, random_plan, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = ["random:smollm2-135m", "random:qwen3-8b"]
CASES = int(os.environ.get("LOCKSTEP_GPU_CASES", "60"))


def _engine(model: str, mode: str = "deterministic", **options):
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    return Engine(
        EngineConfig(
            model=model,
            mode=mode,
            device="cuda",
            dtype="bfloat16",
            kv_tokens=32768,
            max_model_len=8192,
            cuda_graphs=False,
            **options,
        )  # fmt: skip
    )


@pytest.fixture(scope="module", params=MODELS)
def engine(request):
    e = _engine(request.param)
    yield e
    del e
    torch.cuda.empty_cache()


def test_random_schedules_match_cold_prefill(engine) -> None:
    for seed in range(CASES):
        rng = random.Random(seed)
        n = rng.randint(1, 700)
        tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=4)
        problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        assert not problems, f"seed={seed} n={n} {plan.describe()}: " + "; ".join(problems)
    engine.check_integrity()


def test_prefix_hits_at_offsets_around_block_and_split(engine) -> None:
    """Hits ending at every offset near multiples of the key block (64) and split (512)."""
    rng = random.Random(3)
    n = 1100
    tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
    ref = reference(engine, tokens)
    offsets = sorted({o + d for o in (64, 128, 512, 1024) for d in (-1, 0, 1)} | {1, 33, 700})
    for prefix in offsets:
        got = compute(engine, tokens, Plan(prefix, [n - prefix], [[rng.randint(1, 40)]]), rng)
        problems = mismatches(ref, got)
        assert not problems, f"prefix={prefix}: " + "; ".join(problems)
        engine.flush_cache()


def test_generation_logprobs_equal_scoring(engine) -> None:
    from lockstep.engine.llm import LLM
    from lockstep.engine.sampling_params import SamplingParams

    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 300)]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
    for out, score in zip(outs, scores, strict=True):
        assert score.logprobs[len(out.prompt_token_ids) :] == out.logprobs


_RESTART_SCRIPT = """
import json, random, sys, torch
sys.path.insert(0, sys.argv[1])
from tests.support.invariance_harness import reference
from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
e = Engine(EngineConfig(model=sys.argv[2], device="cuda", dtype="bfloat16", kv_tokens=4096,
                        max_model_len=4096, cuda_graphs=False))
rng = random.Random(11)
tokens = [rng.randrange(e.decoder.spec.vocab_size) for _ in range(600)]
def bits(tokens):
    logits = reference(e, tokens).logits[::37, :4096].contiguous()
    return logits.view(torch.int32).flatten().tolist()
print(json.dumps(bits(tokens)))
tokens[0] = (tokens[0] + 1) % e.decoder.spec.vocab_size  # the control: another first token
print(json.dumps(bits(tokens)))
"""


def test_scored_prefix_hits_of_every_length_equal_a_cold_prefill(engine) -> None:
    """Prompt logprobs served from the prefix cache (tests/contract/test_prompt_logprob_cache.py on the
    GPU): after a donor that scored or generated from prompt[:h], scoring the prompt reuses
    h - 1 positions and returns a cold prefill's bits, chosen and top-2, for every h."""
    from tests.contract.test_prompt_logprob_cache import Cold, check_hit

    cold = Cold.__new__(Cold)  # the reference: the same model, no prefix cache
    cold.engine, cold._memo = _engine(engine.config.model, enable_prefix_cache=False), {}
    rng = random.Random(21)
    prompt = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(150)]
    for h in range(1, len(prompt) + 1):
        donor = "score" if h % 2 else "generate"
        problems, cached = check_hit(engine, cold, prompt, h, donor, 2, rng)
        assert not problems, f"h={h} ({donor}): " + "; ".join(problems[:4])
        assert cached == h - 1, f"h={h}: cached_tokens={cached}"
    engine.check_integrity()
    del cold
    torch.cuda.empty_cache()


def test_restart_in_a_second_process(engine) -> None:
    """A fresh process (new engine, new random-weight draw, Triton kernels loaded anew) gives
    the same logits bits as this one, over a 600-token prompt."""
    here = os.path.join(os.path.dirname(__file__), "..", "..")  # the repository root
    model = engine.config.model
    out = subprocess.run(
        [sys.executable, "-c", _RESTART_SCRIPT, here, model],
        capture_output=True, text=True, check=True, timeout=900,
    )  # fmt: skip
    theirs, perturbed = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    rng = random.Random(11)
    tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(600)]
    logits = reference(engine, tokens).logits[::37, :4096].contiguous()
    ours = logits.view(torch.int32).flatten().tolist()
    assert ours == theirs
    assert ours != perturbed, "the comparison did not see a changed input: it is blind"


def test_negative_control_reference_mode_breaks_batch_invariance() -> None:
    engine = _engine("random:smollm2-135m", mode="reference")
    failures = 0
    for seed in range(10):
        rng = random.Random(seed)
        n = rng.randint(16, 200)
        tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=4, allow_prefix=False)
        plan.mates_per_step = [[rng.randint(8, 64) for _ in range(4)] for _ in plan.chunks]
        failures += bool(mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng)))
    assert failures > 0


def test_cuda_graph_decode_equals_eager(monkeypatch) -> None:
    """Whole generations through the engine, decode steps replayed from CUDA graphs (batch
    padding included) with programmatic dependent launch versus eager without it: the same
    tokens and logprobs, bit for bit."""
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine
    from lockstep.engine.sampling_params import SamplingParams
    from lockstep.ops.triton import launch

    results = []
    for graphs in (True, False):
        if not graphs:  # every launch without PDL from here on
            monkeypatch.setattr(launch, "pdl_enabled", lambda device: False)
        assert launch.pdl_launch(torch.device("cuda"), 1)["PDL"] == graphs
        engine = Engine(EngineConfig(model="random:smollm2-135m", device="cuda",
                                     dtype="bfloat16", kv_tokens=16384, max_model_len=4096,
                                     max_running=16, cuda_graphs=graphs))  # fmt: skip
        assert (engine.runner.graphs is not None) == graphs
        rng = random.Random(9)
        for i in range(11):  # 11 sequences: padded to the 16-row bucket
            prompt = [
                rng.randrange(engine.decoder.spec.vocab_size) for _ in range(rng.randint(1, 300))
            ]
            # Sampled, with top-p, top-k or neither: the sampler's kernels run in the batch.
            params = SamplingParams(max_tokens=40, temperature=1.0, seed=1, ignore_eos=True,
                                    top_p=0.9 if i % 3 == 0 else 1.0,
                                    top_k=50 if i % 3 == 1 else 0)  # fmt: skip
            engine.add_request(f"r{i}", prompt, params)
        out: dict[str, list] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).append((o.new_token_ids, o.new_token_logprobs))
        results.append(out)
        if graphs:
            assert engine.runner.graphs.num_graphs > 0
        del engine
        torch.cuda.empty_cache()
    assert results[0] == results[1]


def test_weight_update_under_cuda_graphs_equals_a_fresh_engine() -> None:
    """Weights copied in place are what the captured decode graphs replay: after an update to
    weights B, greedy and sampled generations equal a fresh engine on B, bit for bit; back to
    A, they equal A's again. Control: A and B differ."""
    from lockstep import LLM, SamplingParams
    from lockstep.models.resolver import resolve_model

    options = dict(device="cuda", dtype="bfloat16", kv_tokens=16384, max_model_len=2048,
                   max_running=16)  # fmt: skip
    model = "random:smollm2-135m"
    rng = random.Random(4)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(5, 200))] for _ in range(6)]
    params = [SamplingParams(max_tokens=32, ignore_eos=True, temperature=t, seed=3)
              for t in (0.0, 1.0, 0.0, 1.0, 0.7, 0.0)]  # fmt: skip

    def run(llm: LLM) -> list:
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]

    fresh_b = LLM(model, random_seed=1, **options)
    on_b = run(fresh_b)
    del fresh_b
    llm = LLM(model, random_seed=0, **options)
    on_a = run(llm)
    assert llm.engine.runner.graphs.num_graphs > 0
    assert on_a != on_b
    # A preset's values depend on the device that draws them: B as the fresh engine drew it.
    weights_b = resolve_model(model, random_seed=1).iter_weights(torch.bfloat16, "cuda")
    llm.update_weights(weights_b)
    assert run(llm) == on_b
    llm.update_weights(model)  # from the preset again: the engine's own seed, weights A
    assert run(llm) == on_a
    del llm
    torch.cuda.empty_cache()


def test_overlapped_decode_with_graphs_gives_the_plain_outputs() -> None:
    """`overlap_decode` with CUDA graphs (pending tokens patched into the graph's static
    inputs from the device, padding rows included) against the plain loop: the workload of
    tests/contract/test_overlap_decode.py (arrivals, aborts, stops, sampling, logprobs)."""
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine
    from tests.contract.test_overlap_decode import _drive, _workload, assert_same_outputs

    runs = []
    for overlap in (False, True):
        engine = Engine(EngineConfig(model="random:smollm2-135m", device="cuda",
                                     dtype="bfloat16", kv_tokens=16384, max_model_len=4096,
                                     max_running=8, cuda_graphs=True, overlap_decode=overlap,
                                     debug_checks=True))  # fmt: skip
        work = _workload(5, engine.decoder.spec.vocab_size)
        runs.append((_drive(engine, work), engine.steps_launched_ahead, engine.runner.graphs))
        del engine
        torch.cuda.empty_cache()
    (want, ahead_plain, _), (got, ahead, graphs) = runs
    assert_same_outputs(got, want, work)
    assert ahead > 0 and ahead_plain == 0 and graphs.num_graphs > 0


def test_a_step_launched_ahead_never_waits_for_the_device() -> None:
    """Overlapped decode only helps if launching step N+1 and reading step N's tokens never
    synchronize with the device (a pageable copy, `.item()` or `.tolist()` of a CUDA tensor
    would wait for N+1 too). Steady-state steps (greedy and sampled rows) run under torch's
    sync debug mode set to raise; reading the tokens waits on their own CUDA event, which it
    allows."""
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine
    from lockstep.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model="random:smollm2-135m", device="cuda", dtype="bfloat16",
                                 kv_tokens=16384, max_model_len=4096, max_running=4,
                                 cuda_graphs=True, overlap_decode=True))  # fmt: skip
    for i in range(3):  # greedy, sampled with top-p, sampled with top-k
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=40,
                           temperature=0.0 if i == 0 else 0.8, top_p=0.9 if i == 1 else 1.0,
                           top_k=50 if i == 2 else 0, seed=i, ignore_eos=True))  # fmt: skip
    while engine.steps_launched_ahead < 4:  # prefill, graph capture, steady state
        engine.step()
    before = engine.steps_launched_ahead
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.steps_launched_ahead == before + 6
    # Control: the mode does catch a synchronizing read.
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.ones(1, device="cuda").item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_first_sampling_after_start_up_does_not_wait_for_the_device() -> None:
    """The engine warms the sampler at start-up, so the sampler's first call after it (noise,
    top-p units, top-k; the call a first sampled step makes) makes no synchronizing copy, and
    it runs the Triton kernels. Control: without the cached constants, the upload's pageable
    copy is caught by the same mode."""
    from lockstep.config import EngineConfig
    from lockstep.engine import sampler
    from lockstep.engine.engine import Engine
    from lockstep.engine.sampler import RowSampling, choose_token_tensor
    from lockstep.ops.triton import sampling

    sampling._CONSTANTS.clear()
    engine = Engine(EngineConfig(model="random:smollm2-135m", device="cuda", dtype="bfloat16",
                                 kv_tokens=4096, max_model_len=4096,
                                 cuda_graphs=False))  # fmt: skip
    assert sampler._kernels(torch.device("cuda")) is sampling
    vocab = engine.decoder.spec.vocab_size
    logits = torch.randn(2, vocab, device="cuda")
    rows = [RowSampling(0.7, 0, 0.9, 0.0, 1, 10), RowSampling(1.0, 40, 1.0, 0.0, 2, 10)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        choose_token_tensor(logits, rows)
        sampling._CONSTANTS.clear()
        with pytest.raises(RuntimeError):
            choose_token_tensor(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
