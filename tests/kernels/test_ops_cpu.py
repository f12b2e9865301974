"""CPU numeric backends: accuracy against the float64 reference, and bitwise position
invariance of the deterministic backend (rows vs M, row position, thread count, SIMD path,
query chunking, batch-mates), with negative controls showing the invariance checks can fail."""

from __future__ import annotations

import random

import pytest
import torch

from lockstep.ops.base import LayerKV, build_attention_meta
from lockstep.ops.cpu_deterministic import CpuDeterministicOps
from lockstep.ops.cpu_stock import CpuStockOps
from lockstep.ops.float64 import Float64Ops

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M attention shape
SCALE = D**-0.5


@pytest.fixture(scope="module")
def det() -> CpuDeterministicOps:
    return CpuDeterministicOps()


@pytest.fixture(scope="module")
def ref() -> Float64Ops:
    return Float64Ops()


@pytest.fixture(scope="module")
def stock() -> CpuStockOps:
    return CpuStockOps()


@pytest.fixture
def threads():
    """Restore torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def rope_tables(max_position: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def assert_rows_invariant(op, pool: torch.Tensor, sizes: list[int], seed: int = 0) -> None:
    """op(rows) must give each row the bits it gets alone, for every M and row position."""
    alone = [op(pool[i : i + 1]) for i in range(pool.shape[0])]
    rng = random.Random(seed)
    for m in sizes:
        picks = [rng.randrange(pool.shape[0]) for _ in range(m)]
        out = op(pool[picks])
        for pos, i in enumerate(picks):
            assert torch.equal(out[pos : pos + 1], alone[i]), f"M={m}, row {i} at {pos}"


# ---------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "bias"), [(7, 37, 100, True), (5, 192, 576, False)])
def test_linear_matches_reference(det, ref, wdtype, m, n, k, bias) -> None:
    torch.manual_seed(1)
    x, w = torch.randn(m, k), torch.randn(n, k).to(wdtype)
    b = torch.randn(n) if bias else None
    prepared = det.prepare_linear_weight(w)
    assert prepared.shape == (n, (k + 15) // 16 * 16) and prepared.dtype == wdtype
    out = det.linear(x, prepared, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    close(out, ref.linear(x, w, b), tol=1e-4)
    # An unprepared weight is padded on the fly and gives the same bits.
    assert torch.equal(det.linear(x, w, b), out)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_linear_rows_independent_of_m_and_position(det, wdtype) -> None:
    torch.manual_seed(2)
    w = det.prepare_linear_weight(torch.randn(200, 576).to(wdtype))  # N not a tile multiple
    bias = torch.randn(200)
    pool = torch.randn(100, 576)
    sizes = [1, 2, 3, 4, 5, 7, 8, 16, 33, 100]
    assert_rows_invariant(lambda x: det.linear(x, w, bias), pool, sizes)


def test_linear_independent_of_thread_count(det, threads) -> None:
    torch.manual_seed(3)
    w = det.prepare_linear_weight(torch.randn(300, 1536).to(torch.bfloat16))
    x = torch.randn(70, 1536)
    torch.set_num_threads(1)
    one = det.linear(x, w)
    torch.set_num_threads(2)
    assert torch.equal(det.linear(x, w), one)


def test_stock_linear_is_not_m_invariant(stock) -> None:
    """Negative control: stock torch fp32 GEMM changes row 0's bits with M on this machine,
    so the invariance tests above are able to fail."""
    torch.manual_seed(4)
    found = []
    for n, k in [(576, 576), (1536, 576), (576, 1536), (192, 576)]:
        w = torch.randn(n, k)
        x = torch.randn(16, k)
        alone = stock.linear(x[:1], w)
        for m in (4, 16):
            if not torch.equal(stock.linear(x[:m], w)[:1], alone):
                found.append((n, k, m))
    assert found, "torch fp32 GEMM row 0 was the same at M=1 and M>=4 for every shape tried"


# ---------------------------------------------------------------------------------------
# SIMD paths: AVX-512, AVX2 and scalar code define the same arithmetic
# ---------------------------------------------------------------------------------------


def test_simd_paths_give_identical_bits(det) -> None:
    torch.manual_seed(5)
    variants = det._ext.simd_variants()
    assert "scalar" in variants
    w = det.prepare_linear_weight(torch.randn(50, 200).to(torch.bfloat16))
    x = torch.randn(9, 200) * 3
    norm_w = torch.randn(200)
    logits = torch.randn(3, 1000) * 5
    q, k_cache, v_cache, meta = random_batch(torch.bfloat16, [(40, 30), (1, 70)], seed=5)
    results = {}
    for name in variants:
        ops = CpuDeterministicOps(simd=name)
        results[name] = (
            ops.linear(x, w),
            ops.rms_norm(x, norm_w, 1e-5),
            ops.silu_mul(x),
            ops.gelu_tanh_mul(x),
            ops.softcap(logits, 3.0),
            ops.log_softmax(logits),
            ops.attention(q, LayerKV(k_cache, v_cache), meta, SCALE),
            ops.attention(q, LayerKV(k_cache, v_cache), meta, SCALE, window=9),
        )
    for name in variants:
        for got, want in zip(results[name], results["scalar"], strict=True):
            assert torch.equal(got, want), name


# ---------------------------------------------------------------------------------------
# row-wise ops
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("h", [576, 100])
def test_rms_norm(det, ref, h) -> None:
    torch.manual_seed(6)
    x, res, w = torch.randn(37, h), torch.randn(37, h), torch.randn(h)
    close(det.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    out, summed = det.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_sum = ref.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, x + res)  # the residual add is exact
    close(out, ref_out)
    close(summed, ref_sum)
    sizes = [1, 2, 5, 16, 37]
    assert_rows_invariant(lambda r: det.rms_norm(r, w, 1e-5), x, sizes)
    both = torch.cat([x, res], dim=1)
    assert_rows_invariant(
        lambda r: torch.cat(det.add_rms_norm(r[:, :h], r[:, h:], w, 1e-6), dim=1), both, sizes
    )


def test_silu_mul(det, ref) -> None:
    torch.manual_seed(7)
    inter = 1536 + 5  # a tail that is not a multiple of the vector width
    gate_up = torch.randn(20, 2 * inter) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    close(det.silu_mul(gate_up), ref.silu_mul(gate_up))
    assert_rows_invariant(det.silu_mul, gate_up, [1, 3, 16, 20])
    # One formula for every element: moving a value to another column (vector body vs tail)
    # keeps its bits.
    gate, up = gate_up.chunk(2, dim=1)
    shift = 7
    rolled = torch.cat([gate.roll(shift, 1), up.roll(shift, 1)], dim=1)
    assert torch.equal(det.silu_mul(rolled), det.silu_mul(gate_up).roll(shift, 1))


def test_gelu_tanh_mul(det, ref) -> None:
    """Gemma's GeGLU activation: the float64 formula, row-local, one formula per element."""
    torch.manual_seed(7)
    inter = 640 + 5
    gate_up = torch.randn(20, 2 * inter) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    close(det.gelu_tanh_mul(gate_up), ref.gelu_tanh_mul(gate_up))
    assert_rows_invariant(det.gelu_tanh_mul, gate_up, [1, 3, 16, 20])
    gate, up = gate_up.chunk(2, dim=1)
    rolled = torch.cat([gate.roll(7, 1), up.roll(7, 1)], dim=1)
    assert torch.equal(det.gelu_tanh_mul(rolled), det.gelu_tanh_mul(gate_up).roll(7, 1))


def test_softcap(det, ref) -> None:
    """cap * tanh(x / cap) per element: the float64 formula (the tails exactly +-cap), and a
    value's bits wherever it sits (vector body or tail, any tensor shape)."""
    torch.manual_seed(9)
    x = torch.randn(7, 1000 + 3) * 40
    x[0, :4] = torch.tensor([-1e4, 1e4, 0.0, 1e-30])
    close(det.softcap(x, 30.0), ref.softcap(x, 30.0))
    assert det.softcap(x, 30.0)[0, :2].tolist() == [-30.0, 30.0]
    assert torch.equal(det.softcap(x.roll(5, 1), 30.0), det.softcap(x, 30.0).roll(5, 1))
    assert torch.equal(det.softcap(x[3:4], 30.0), det.softcap(x, 30.0)[3:4])


def test_log_softmax(det, ref) -> None:
    torch.manual_seed(8)
    logits = torch.randn(12, 49152 + 3) * 6
    out = det.log_softmax(logits)
    assert out.dtype == torch.float32
    close(out, ref.log_softmax(logits), tol=2e-5)
    assert_rows_invariant(det.log_softmax, logits, [1, 2, 5, 12])


def test_rope(det, ref, stock) -> None:
    torch.manual_seed(9)
    cos, sin = rope_tables(4096)
    x = torch.randn(33, HQ, D)
    positions = torch.randint(0, 4096, (33,))
    out = det.rope(x, positions, cos, sin)
    close(out, ref.rope(x, positions, cos, sin))
    # Separate fp32 multiplies and adds per element: the same bits as eager torch.
    assert torch.equal(out, stock.rope(x, positions, cos, sin))
    assert torch.equal(det.rope(x[5:6], positions[5:6], cos, sin), out[5:6])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_is_exact_copy(det, cache_dtype) -> None:
    torch.manual_seed(10)
    k_cache = torch.zeros(50, HKV, D, dtype=cache_dtype)
    v_cache = torch.zeros(50, HKV, D, dtype=cache_dtype)
    k, v = torch.randn(6, HKV, D), torch.randn(6, HKV, D)
    slots = torch.tensor([3, 17, 4, 49, 0, 22], dtype=torch.int32)
    det.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache[slots.long()], k.to(cache_dtype))
    assert torch.equal(v_cache[slots.long()], v.to(cache_dtype))
    assert k_cache.abs().sum(dim=(1, 2)).count_nonzero() == 6


# ---------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------


class Sequence:
    """One sequence's queries and its keys/values scattered over random cache slots."""

    def __init__(self, length: int, slots: list[int], gen: torch.Generator) -> None:
        self.length = length
        self.slots = slots
        self.q = torch.randn(length, HQ, D, generator=gen)
        self.k = torch.randn(length, HKV, D, generator=gen) * 2
        self.v = torch.randn(length, HKV, D, generator=gen)


def make_cache(cache_dtype: torch.dtype, lengths: list[int], seed: int):
    """A cache of random junk with each sequence's K/V written at random distinct slots."""
    gen = torch.Generator().manual_seed(seed)
    size = sum(lengths) * 2 + 64
    k_cache = torch.randn(size, HKV, D, generator=gen).to(cache_dtype)
    v_cache = torch.randn(size, HKV, D, generator=gen).to(cache_dtype)
    perm = torch.randperm(size, generator=gen).tolist()
    seqs, used = [], 0
    for n in lengths:
        seq = Sequence(n, perm[used : used + n], gen)
        used += n
        k_cache[seq.slots] = seq.k.to(cache_dtype)
        v_cache[seq.slots] = seq.v.to(cache_dtype)
        seqs.append(seq)
    return seqs, k_cache, v_cache


def call(
    ops, k_cache, v_cache, parts: list[tuple[Sequence, int, int]], window: int | None = None
) -> torch.Tensor:
    """Attention for query rows [start, start+n) of each (sequence, start, n) in one call."""
    meta = build_attention_meta(
        [n for _, _, n in parts], [s for _, s, _ in parts], [seq.slots for seq, _, _ in parts]
    )
    q = torch.cat([seq.q[s : s + n] for seq, s, n in parts])
    return ops.attention(q, LayerKV(k_cache, v_cache), meta, SCALE, window)


def random_batch(cache_dtype: torch.dtype, specs: list[tuple[int, int]], seed: int):
    """q, caches and meta for sequences given as (query rows, cached prefix length)."""
    seqs, k_cache, v_cache = make_cache(cache_dtype, [n + s for n, s in specs], seed)
    meta = build_attention_meta(
        [n for n, _ in specs], [s for _, s in specs], [seq.slots for seq in seqs]
    )
    q = torch.cat([seq.q[s : s + n] for seq, (n, s) in zip(seqs, specs, strict=True)])
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_reference(det, ref, stock, cache_dtype) -> None:
    specs = [(70, 0), (1, 100), (13, 37), (33, 64)]
    q, k_cache, v_cache, meta = random_batch(cache_dtype, specs, seed=11)
    out = det.attention(q, LayerKV(k_cache, v_cache), meta, SCALE)
    assert out.shape == q.shape and out.dtype == torch.float32
    expected = ref.attention(q, LayerKV(k_cache, v_cache), meta, SCALE)
    close(out, expected)
    close(stock.attention(q, LayerKV(k_cache, v_cache), meta, SCALE), expected)


@pytest.mark.parametrize("window", [1, 9, 40])
def test_sliding_window_attention(det, ref, stock, window: int) -> None:
    """Sliding windows (Gemma 3) of 1 key, less than a key block and more than one: the
    reference, reference mode, and every row's bits under chunking and batch-mates equal to a
    full prefill's (rows' windows starting inside, at and past block edges)."""
    (seq, other), k_cache, v_cache = make_cache(torch.float32, [100, 60], seed=12)
    full = call(det, k_cache, v_cache, [(seq, 0, 100)], window)
    want = call(ref, k_cache, v_cache, [(seq, 0, 100)], window)
    close(full, want)
    close(call(stock, k_cache, v_cache, [(seq, 0, 100)], window), want)
    assert not torch.equal(full, call(det, k_cache, v_cache, [(seq, 0, 100)]))  # it masks
    rng = random.Random(window)
    for start in range(0, 100, 7):
        n = min(100 - start, rng.randint(1, 40))
        mate = rng.randrange(60)
        parts = [(other, mate, 60 - mate), (seq, start, n)]
        got = call(det, k_cache, v_cache, parts, window)[60 - mate :]
        assert torch.equal(got, full[start : start + n]), (start, n)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_independent_of_chunking_and_batch(det, cache_dtype) -> None:
    rng = random.Random(12)
    lengths = [150, 97, 40, 1, 64]
    seqs, k_cache, v_cache = make_cache(cache_dtype, lengths, seed=12)
    target, others = seqs[0], seqs[1:]
    full = call(det, k_cache, v_cache, [(target, 0, target.length)])

    # Random chunks, each beside random batch-mates at a random place in the call.
    for trial in range(4):
        start = 0
        while start < target.length:
            n = min(rng.randint(1, 60), target.length - start)
            mates = []
            for seq in rng.sample(others, rng.randint(0, len(others))):
                s = rng.randrange(seq.length)
                mates.append((seq, s, rng.randint(1, seq.length - s)))
            where = rng.randint(0, len(mates))
            parts = mates[:where] + [(target, start, n)] + mates[where:]
            out = call(det, k_cache, v_cache, parts)
            offset = sum(p[2] for p in parts[:where])
            got = out[offset : offset + n]
            assert torch.equal(got, full[start : start + n]), f"trial {trial}, rows {start}+{n}"
            start += n

    # Decode: one row at a time with all earlier keys already in the cache.
    for pos in range(target.length):
        assert torch.equal(call(det, k_cache, v_cache, [(target, pos, 1)]), full[pos : pos + 1])


def test_attention_independent_of_thread_count(det, threads) -> None:
    q, k_cache, v_cache, meta = random_batch(torch.bfloat16, [(90, 20), (1, 300)], seed=13)
    torch.set_num_threads(1)
    one = det.attention(q, LayerKV(k_cache, v_cache), meta, SCALE)
    torch.set_num_threads(2)
    assert torch.equal(det.attention(q, LayerKV(k_cache, v_cache), meta, SCALE), one)


def test_attention_key_block_changes_bits(det) -> None:
    """Negative control: a different key block (a different reduction order) is visible in
    the bits, so the chunking test above compares something that can differ."""
    q, k_cache, v_cache, meta = random_batch(torch.float32, [(150, 0)], seed=14)
    base = det.attention(q, LayerKV(k_cache, v_cache), meta, SCALE)
    other = CpuDeterministicOps(key_block=16).attention(q, LayerKV(k_cache, v_cache), meta, SCALE)
    close(other, base)
    differing = (base != other).any(dim=(1, 2)).sum().item()
    assert differing > 50, f"only {differing} of 150 rows changed with the key block"


def test_attention_rejects_bad_metadata(det) -> None:
    q, k_cache, v_cache, meta = random_batch(torch.float32, [(4, 0)], seed=15)
    bad = build_attention_meta([4], [0], [[0, 1, 2, k_cache.shape[0]]])
    with pytest.raises(RuntimeError, match="outside the cache"):
        det.attention(q, LayerKV(k_cache, v_cache), bad, SCALE)


def test_missing_compiler_is_a_clear_error(monkeypatch) -> None:
    from lockstep.ops import cpu_build

    monkeypatch.setattr(cpu_build, "_module", None)
    monkeypatch.setenv("CXX", "no-such-compiler-lockstep")
    with pytest.raises(cpu_build.KernelBuildError, match="needs a C\\+\\+ compiler"):
        cpu_build.load_extension()


@pytest.mark.parametrize("head_dim", [32, 128])
def test_attention_other_head_dims(det, ref, head_dim) -> None:
    """Every instantiated head_dim agrees with the reference and is chunk-invariant."""
    gen = torch.Generator().manual_seed(13)
    n = 90
    q = torch.randn(n, 4, head_dim, generator=gen)
    k = torch.randn(n, 2, head_dim, generator=gen)
    v = torch.randn(n, 2, head_dim, generator=gen)
    slots = torch.randperm(n, generator=gen)
    k_cache, v_cache = torch.empty_like(k), torch.empty_like(v)
    k_cache[slots], v_cache[slots] = k, v
    full = det.attention(q, LayerKV(k_cache, v_cache), build_attention_meta([n], [0], [slots]), 0.2)
    close(
        full,
        ref.attention(q, LayerKV(k_cache, v_cache), build_attention_meta([n], [0], [slots]), 0.2),
    )
    chunks = []
    for s in range(0, n, 17):
        e = min(n, s + 17)
        meta = build_attention_meta([e - s], [s], [slots])
        chunks.append(det.attention(q[s:e].contiguous(), LayerKV(k_cache, v_cache), meta, 0.2))
    assert torch.equal(torch.cat(chunks), full)


def test_unsupported_head_dim_is_refused(det) -> None:
    q = torch.randn(2, 2, 48)
    cache = torch.randn(2, 2, 48)
    with pytest.raises(RuntimeError, match="head_dim"):
        det.attention(q, LayerKV(cache, cache), build_attention_meta([2], [0], [[0, 1]]), 0.2)
