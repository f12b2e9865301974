"""The CPU latent-attention kernel (`CpuDeterministicOps.latent_attention`, MLA's absorbed
form): agreement with a float64 reference, and a row's bits whatever the chunking, the
batch-mates, the SIMD path and the thread count; the stock SDPA formulation as the control."""

from __future__ import annotations

import random

import pytest
import torch

from lockstep.ops.base import build_attention_meta
from lockstep.ops.cpu_deterministic import CpuDeterministicOps
from lockstep.ops.cpu_stock import CpuStockOps

HEADS, WIDTH, VALUES, SLOTS = 20, 96, 64, 400  # 20 heads: two head tiles of the kernel


@pytest.fixture(scope="module")
def ops() -> CpuDeterministicOps:
    return CpuDeterministicOps()


def _cache(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(SLOTS, 1, WIDTH).to(dtype)


def _run(ops, q: torch.Tensor, cache: torch.Tensor, parts: list[tuple[int, int, list[int]]]):
    """Latent attention of several sequences in one call: (first position, rows, slot table)
    each; q rows concatenated in that order."""
    meta = build_attention_meta([n for _, n, _ in parts], [s for s, _, _ in parts],
                                [t for _, _, t in parts])  # fmt: skip
    return ops.latent_attention(q, cache, meta, 0.125, VALUES)


def _reference(q: torch.Tensor, cache: torch.Tensor, table: list[int]) -> torch.Tensor:
    rows = cache[torch.tensor(table), 0].double()
    out = torch.empty(q.shape[0], HEADS, VALUES, dtype=torch.float64)
    for p in range(q.shape[0]):
        scores = torch.einsum("hw,lw->hl", q[p].double(), rows[: p + 1]) * 0.125
        out[p] = torch.softmax(scores, -1) @ rows[: p + 1, :VALUES]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_float64_reference(ops, dtype: torch.dtype) -> None:
    cache = _cache(dtype)
    table = random.Random(1).sample(range(SLOTS), 70)
    q = torch.randn(70, HEADS, WIDTH)
    got = _run(ops, q, cache, [(0, 70, table)])
    assert (got.double() - _reference(q, cache, table)).abs().max() < 1e-5


def test_rows_keep_their_bits_under_any_split(ops) -> None:
    """A 75-token sequence (keys over three 32-key blocks) with scattered slots: one prefill,
    random chunks beside random batch-mates at a random place in the call, and 75 one-row
    decode steps give the same bits; so do every SIMD path and 1 or 2 threads."""
    rng = random.Random(7)
    cache = _cache(torch.float32)
    n = 75
    table = rng.sample(range(SLOTS), n)
    q = torch.randn(n, HEADS, WIDTH)
    whole = _run(ops, q, cache, [(0, n, table)])
    start = 0
    while start < n:
        size = rng.randint(1, 20)
        end = min(n, start + size)
        mates = [(rng.randint(0, 40), rng.randint(1, 9)) for _ in range(rng.randint(0, 3))]
        parts = [(s, m, rng.sample(range(SLOTS), s + m)) for s, m in mates]
        at = rng.randint(0, len(parts))
        parts.insert(at, (start, end - start, table))
        qs = [torch.randn(m, HEADS, WIDTH) for _, m, _ in parts]
        qs[at] = q[start:end]
        out = _run(ops, torch.cat(qs), cache, parts)
        offset = sum(m for _, m, _ in parts[:at])
        assert torch.equal(out[offset : offset + end - start], whole[start:end]), (start, end)
        start = end
    decode = torch.cat([_run(ops, q[p : p + 1], cache, [(p, 1, table)]) for p in range(n)])
    assert torch.equal(decode, whole)
    for simd in CpuDeterministicOps()._ext.simd_variants():
        assert torch.equal(_run(CpuDeterministicOps(simd=simd), q, cache, [(0, n, table)]), whole)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(ops, q, cache, [(0, n, table)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, whole)


def test_negative_control_stock_sdpa_changes_bits_with_the_split() -> None:
    """The stock formulation (torch SDPA over the gathered rows) gives a row other bits as a
    decode step than inside a prefill: the checks above can fail."""
    stock = CpuStockOps()
    cache = _cache(torch.float32)
    n = 75
    table = random.Random(3).sample(range(SLOTS), n)
    q = torch.randn(n, HEADS, WIDTH)
    whole = _run(stock, q, cache, [(0, n, table)])
    decode = torch.cat([_run(stock, q[p : p + 1], cache, [(p, 1, table)]) for p in range(n)])
    assert not torch.equal(decode, whole)
