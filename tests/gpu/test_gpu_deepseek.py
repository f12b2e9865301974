"""DeepSeek-architecture models (MLA + DeepSeek MoE routing) on the GPU, CUDA graphs on: decode
replayed from graphs (batch padding included) equals eager decode; one request among 64
batch-mates equals the request alone; decode logprobs over 512+ generated tokens equal a
teacher-forced rescoring (prefill); reference mode breaks batch invariance (the control).
`LOCKSTEP_GPU_DEEPSEEK_MODEL` picks the model (default random:deepseek-v2-lite, 31 GiB in
bf16); one engine lives at a time. And the latent-attention kernel alone at DeepSeek-V2-Lite's
and V3's head counts (16 and 128, W = 512 + 64) over contexts up to ~5k keys, so the split
path runs: decode tiles (fold and split paths, beside 63 batch-mates, from a CUDA graph) give
the prefill tiles' bits."""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import torch
from gpu_engines import (
    OneEngine,
    check_decode_equals_teacher_forced_scoring,
    check_graph_decode_equals_eager,
    check_one_request_among_64_batch_mates,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = os.environ.get("LOCKSTEP_GPU_DEEPSEEK_MODEL", "random:deepseek-v2-lite")


@pytest.fixture(scope="module")
def engines():
    one = OneEngine(MODEL, max_model_len=2048)
    yield one
    one.release()


@pytest.fixture
def graphed(engines):
    llm = engines.get()
    assert llm.engine.runner.graphs is not None
    return llm


def test_graph_decode_equals_eager(engines) -> None:
    check_graph_decode_equals_eager(engines)


def test_one_request_among_64_batch_mates_equals_it_alone(graphed) -> None:
    check_one_request_among_64_batch_mates(graphed)
    graphed.engine.check_integrity()


def test_decode_over_512_tokens_equals_teacher_forced_scoring(graphed) -> None:
    check_decode_equals_teacher_forced_scoring(graphed)


def test_negative_control_reference_mode_differs_among_batch_mates(engines) -> None:
    check_one_request_among_64_batch_mates(engines.get(mode="reference"), equal=False)


# ------------------------------------------------------------------- the kernel alone


def _latent_case(heads: int, length: int, mates: int, cache_dtype: torch.dtype, seed: int):
    """A sequence of `length` keys scattered over a pool beside `mates` other sequences'
    keys: (cache [S, 1, 576], q [length, H, 576] bf16, its slot table, mate tables)."""
    rng = random.Random(seed)
    mate_lens = [rng.randint(1, length) for _ in range(mates)]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(length + sum(mate_lens), generator=g).tolist()
    table, at, tables = perm[:length], length, []
    for n in mate_lens:
        tables.append(perm[at : at + n])
        at += n
    cache = torch.randn(len(perm), 1, 576, generator=g).to("cuda", torch.bfloat16)
    q = (torch.randn(length, heads, 576, generator=g) * 0.5).to("cuda", torch.bfloat16)
    return cache.to(cache_dtype), q, table, tables


@pytest.mark.parametrize(
    ("heads", "length", "cache_dtype"),
    [(16, 5000, torch.bfloat16), (128, 4700, torch.bfloat16), (16, 3000, torch.float8_e4m3fn)],
)
def test_latent_decode_tiles_match_prefill_tiles(heads, length, cache_dtype) -> None:
    """A prefill in chunks of 1,024 rows (prefill tiles) against one-row decodes at
    positions around block and split edges on the fold and split paths forced and on the
    wrapper's path beside 63 batch-mates, and a 64-sequence decode replayed from a CUDA
    graph: every row's float32 output bits equal. Negative control: decode tiles with
    twice the split differ."""
    from lockstep.ops.base import build_attention_meta
    from lockstep.ops.triton.latent_attention import DEFAULT_LATENT_CONFIG as cfg
    from lockstep.ops.triton.latent_attention import latent_attention

    cache, q, table, tables = _latent_case(heads, length, 63, cache_dtype, seed=heads + length)
    scale = 192**-0.5

    def run(start, count, path=None, config=cfg, mates=()):
        counts = [1] * len(mates) + [count]
        starts = [len(tables[i]) - 1 for i in mates] + [start]
        meta = build_attention_meta(counts, starts, [tables[i] for i in mates] + [table])
        qs = [mate_q[i] for i in mates] + [q[start : start + count]]
        out = latent_attention(torch.cat(qs), cache, meta.to("cuda"), scale, 512, config,
                               path, torch.float32)  # fmt: skip
        return out[len(mates) :]

    mate_q = [(torch.randn(1, heads, 576) * 0.5).to("cuda", torch.bfloat16) for _ in tables]
    full = torch.cat([run(s, min(1024, length - s), "prefill") for s in range(0, length, 1024)])
    edges = {0, 31, 32, 255, 256, 257, 511, 512, 1023, 1024, 2047, 2048, length - 1}
    positions = sorted(edges | set(random.Random(1).sample(range(length), 24)))
    for p in positions:
        for path in ("fold", "split"):
            assert torch.equal(run(p, 1, path), full[p : p + 1]), (heads, p, path)
    for p in positions[::4]:
        assert torch.equal(run(p, 1, mates=range(63)), full[p : p + 1]), (heads, p)
    bad = replace(cfg, split=2 * cfg.split)
    assert not torch.equal(torch.cat([run(p, 1, "split", bad) for p in positions]),
                           torch.cat([full[p : p + 1] for p in positions]))  # fmt: skip

    # 64 decodes (the sequence at its last position, then 63 mates) from a CUDA graph.
    meta = build_attention_meta([1] * 64, [length - 1] + [len(t) - 1 for t in tables],
                                [table, *tables]).to("cuda")  # fmt: skip
    qs = torch.cat([q[length - 1 :], *mate_q])
    eager = latent_attention(qs, cache, meta, scale, 512, cfg, None, torch.float32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = latent_attention(qs, cache, meta, scale, 512, cfg, None, torch.float32)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert torch.equal(captured[:1], full[length - 1 :])
