"""The RL control surface on CUDA (docs/rl.md): memory handed back to the GPU and taken again
(lockstep/engine/memory_occupation.py), an 8B refit from a trainer's process group
(lockstep/engine/weight_receiver.py), and a pause under CUDA graphs and overlapped decode.

- Releasing both tags raises `torch.cuda.mem_get_info`'s free memory by at least 95% of the
  weights' and the KV pool's bytes; resuming gives a fixed seeded request its bits again, from
  CUDA graphs captured anew (control: another seed differs).
- The timings of the release, the resume and a Qwen3-8B-shaped refit from a trainer
  process's group (gloo on one GPU; NCCL with two) are printed as JSON lines (the aim: a
  refit under 10 s); the refit's served bits equal the trainer's weights loaded directly
  (control: they differ from the weights before).
- A run paused mid-way (the step launched ahead completed, requests retracted or kept in
  place) gives, resumed, the bits of a run never paused (tests/unit/engine/test_pause.py's
  run, on the GPU's default path: CUDA graphs, overlapped decode).
- Routed experts (`return_routed_experts`) on a MoE preset: the routing store written inside
  the decode graphs equals the eager engine's, a run alone's and a cold prefill's (control:
  reference mode routes otherwise).

    python -m pytest tests/gpu/test_gpu_rl.py -x -q -s
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODEL = "random:qwen3-8b"
PROMPT = [(37 * j) % 5000 + 100 for j in range(200)]


def _llm(model: str = MODEL, **options):
    from lockstep import LLM

    return LLM(model, device="cuda", dtype="bfloat16", kv_tokens=65536, max_model_len=4096,
               **options)  # fmt: skip


def _probe(llm, seed: int = 11) -> tuple[list[int], list[float]]:
    from lockstep import SamplingParams

    params = SamplingParams(max_tokens=32, temperature=1.0, seed=seed, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    return out.token_ids, out.logprobs


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the distinct storages under `tensors` (views share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_release_both_frees_the_memory_and_resume_gives_the_same_bits() -> None:
    from lockstep.engine.memory_occupation import MemoryOccupation, _weight_tensors

    llm = _llm()
    engine = llm.engine
    before = _probe(llm)
    assert _probe(llm, seed=12) != before  # the control: the probe sees a change
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.num_graphs > 0
    weight_bytes = _storage_bytes(_weight_tensors(engine.decoder))
    pool_bytes = _storage_bytes([engine.pool._k, engine.pool._v])
    memory = MemoryOccupation(engine)
    free_before = _free()
    started = time.perf_counter()
    memory.release(("kv_cache", "weights"))
    release_s = time.perf_counter() - started
    gained = _free() - free_before
    assert gained >= 0.95 * (weight_bytes + pool_bytes), (gained, weight_bytes, pool_bytes)
    assert graphs.num_graphs == 0
    started = time.perf_counter()
    memory.resume(("kv_cache", "weights"))
    resume_s = time.perf_counter() - started
    assert _probe(llm) == before
    assert graphs.num_graphs > 0  # captured again, and replayed by the probe
    print(json.dumps({"model": MODEL, "weights_gib": weight_bytes / 2**30,
                      "kv_pool_gib": pool_bytes / 2**30, "freed_gib": gained / 2**30,
                      "release_s": release_s, "resume_s": resume_s,
                      "device": torch.cuda.get_device_name()}))  # fmt: skip


def _trainer(port: int, model: str, backend: str, ready: mp.Queue) -> None:
    """Rank 0: the preset's weights drawn with another seed than the engine's, broadcast over
    NCCL from cuda:1, or over gloo from host copies (drawn on cuda:0, as the engine draws)."""
    device = "cuda:1" if backend == "nccl" else "cuda:0"
    torch.cuda.set_device(device)
    from lockstep.models.resolver import resolve_model
    from lockstep.training.weight_sync import broadcast_weights, join_weight_group

    loaded = resolve_model(model, random_seed=1)
    pairs = [(n, t if backend == "nccl" else t.cpu())
             for n, t in loaded.iter_weights(torch.bfloat16, device)]  # fmt: skip
    group = join_weight_group("127.0.0.1", port, 0, 2, "refit", backend, timeout_s=600)
    ready.put([(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in pairs])
    broadcast_weights(pairs, group)
    torch.cuda.synchronize()


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_refit_from_a_trainers_group(backend: str) -> None:
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs two GPUs (one per rank)")
    from lockstep.engine import weight_receiver

    llm = _llm()
    engine = llm.engine
    initial = _probe(llm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(port, MODEL, backend, ready))
    trainer.start()
    weight_receiver.init_group(engine, "127.0.0.1", port, 1, 2, "refit", backend, 600.0)
    declared = ready.get(timeout=600)
    names, dtypes, shapes = (list(x) for x in zip(*declared, strict=True))
    started = time.perf_counter()
    weight_receiver.update_from_group(engine, "refit", names, dtypes, shapes, "refit-1")
    torch.cuda.synchronize()
    refit_s = time.perf_counter() - started
    trainer.join(600)
    assert trainer.exitcode == 0
    weight_receiver.destroy_group(engine, "refit")
    # The served bits are those of an engine that loaded the trainer's weights itself.
    served = _probe(llm)
    assert served != initial  # the control: the refit changed the weights
    llm.close()
    del llm, engine
    torch.cuda.empty_cache()
    direct = _llm(MODEL, random_seed=1)
    assert _probe(direct) == served
    print(json.dumps({"model": MODEL, "backend": backend, "refit_s": refit_s,
                      "tensors": len(names), "device": torch.cuda.get_device_name()}))  # fmt: skip


@pytest.mark.parametrize("pause", ["retract", "in_place"])
def test_a_paused_run_gives_the_unpaused_bits_on_cuda(pause: str) -> None:
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine
    from tests.unit.engine.test_pause import _run

    engine = Engine(EngineConfig(model="random:smollm2-135m", device="cuda", dtype="bfloat16",
                                 kv_tokens=8192, max_model_len=2048, debug_checks=True))  # fmt: skip
    assert engine.runner.graphs is not None and engine.config.use_overlap_decode
    unpaused = _run(engine, seed=100)
    engine.flush_cache()
    assert _run(engine, seed=100, pause=pause) == unpaused
    assert _run(engine, seed=200) != unpaused  # the control
    assert engine.runner.graphs.num_graphs > 0


ROUTED_MODEL = "random:deepseek-v2-lite"  # MLA + DeepSeek routing, its first layer dense


def _routed(llm, prompts: list[list[int]], first: int = 0) -> list[tuple[list[int], object]]:
    """Each prompt's sampled tokens and routed experts (one request per prompt, prompt j
    seeded 50 + first + j: `first` is its index in the batch it is compared with)."""
    from lockstep import SamplingParams

    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=50 + first + j,
                             ignore_eos=True, return_routed_experts=True)
              for j in range(len(prompts))]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.routed_experts) for o in outs]


def test_routed_experts_under_cuda_graphs_equal_eager_and_a_run_alone() -> None:
    """`return_routed_experts` on a MoE preset: the routing store written inside the decode
    graphs (`Ops.moe`'s device copy) equals the eager engine's, each request's equals its run
    with no batch-mates and its cold full prefill's; the dense first layer's rows are zero.
    Control: reference mode routes some position otherwise."""
    import gc

    import numpy as np

    from lockstep.cache.routed_experts import sglang_layout
    from tests.gpu.gpu_engines import make_llm, random_prompts

    prompts = random_prompts(8, seed=5, longest=200)
    results = {}
    for name, options in [("graphs", {}), ("eager", {"cuda_graphs": False}),
                          ("reference", {"mode": "reference"})]:  # fmt: skip
        llm = make_llm(ROUTED_MODEL, enable_return_routed_experts=True, **options)
        if name == "graphs":
            assert llm.engine.runner.graphs is not None
        results[name] = _routed(llm, prompts)
        if name == "graphs":
            assert llm.engine.runner.graphs.num_graphs > 0  # decode steps replayed graphs
            decoder = llm.engine.decoder
            for prompt, (tokens, routed) in zip(prompts, results[name], strict=True):
                assert routed.shape == (len(prompt) + 31, decoder.spec.num_layers, 6)
                assert not routed[:, 0].any()
                _, kv = decoder.cold_prefill(prompt + tokens[:-1], routed_experts=True)
                assert np.array_equal(routed, sglang_layout(decoder.spec, kv.routed_experts))
            for i in (0, 3, 7):
                llm.engine.flush_cache()
                ((tokens, routed),) = _routed(llm, [prompts[i]], first=i)
                assert tokens == results[name][i][0]
                assert np.array_equal(routed, results[name][i][1])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for (t1, r1), (t2, r2) in zip(results["graphs"], results["eager"], strict=True):
        assert t1 == t2 and np.array_equal(r1, r2)
    assert any(not np.array_equal(a[1], b[1])
               for a, b in zip(results["graphs"], results["reference"], strict=True))  # fmt: skip
