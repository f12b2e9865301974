"""The Triton latent-attention kernel (lockstep/ops/triton/latent_attention.py) against the CPU
kernel and a float64 reference, and a row's bits under every schedule: whole-prompt prefill,
chunked prefill, one-row decode on the fold and split paths, batch-mates, the split path's
waves, value-column chunks. Negative controls show the bit checks can fail. The GPU DeepSeek
routing (`GpuDeterministicOps.route_deepseek`) against the CPU backend's, ties included.

Without CUDA the kernels run under the Triton interpreter (float32, small widths, a small
config so that key blocks and splits are crossed by short sequences); with CUDA on the GPU in
bfloat16 at DeepSeek-V2-Lite's widths (W = 512 + 64, 16 heads) and the production config.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from lockstep.ops.base import build_attention_meta
from lockstep.ops.cpu_deterministic import CpuDeterministicOps
from lockstep.ops.gpu_deterministic import GpuDeterministicOps
from lockstep.ops.moe import DeepseekRouting, MoeLayer
from lockstep.ops.triton.latent_attention import (
    DEFAULT_LATENT_CONFIG,
    LatentConfig,
    latent_attention,
)

GPU = torch.cuda.is_available()
if not GPU:  # the interpreter's tl.dot rounds by block shape: use the row-local one
    from test_ops_triton import _row_local_interpreter_dot

    _row_local_interpreter_dot()
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
TOL = 2e-2 if GPU else 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

if GPU:
    HEADS, DL, DR, SEQ = 16, 512, 64, 1100
    CFG = DEFAULT_LATENT_CONFIG
else:  # 4 heads: a 16-row decode tile holds 4 positions, a 32-row prefill tile 8
    HEADS, DL, DR, SEQ = 4, 32, 16, 45
    CFG = LatentConfig(block_n=16, split=32, rows=32, rows_split=16, value_cols=16)
W = DL + DR
SCALE = W**-0.5


class LatentPool:
    """One sequence's cache rows scattered over random slots of a pool, and batch-mates."""

    def __init__(self, seed: int, mates: int = 2, heads: int = HEADS) -> None:
        rng = random.Random(seed)
        self.mate_lens = [rng.randint(1, SEQ + 10) for _ in range(mates)]
        total = SEQ + sum(self.mate_lens) + 5
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
        self.table, at = perm[:SEQ], SEQ
        self.mate_tables = []
        for n in self.mate_lens:
            self.mate_tables.append(perm[at : at + n])
            at += n
        g = torch.Generator().manual_seed(seed + 1)
        self.cache = torch.randn(total, 1, W, generator=g).to(DEV, DTYPE)
        self.q = torch.randn(SEQ, heads, W, generator=g).to(DEV, DTYPE)
        self.mate_q = [torch.randn(n, heads, W, generator=g).to(DEV, DTYPE)
                       for n in self.mate_lens]  # fmt: skip

    def run(self, start: int, count: int, mates: list[tuple[int, int, int]] = (),
            cfg: LatentConfig = CFG, path: str | None = None,
            q: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Rows start..start+count-1 of the sequence after mates (index, start, count);
        float32 out (every bit of the kernel's result)."""
        qs, counts, starts, tables = [], [], [], []
        for i, s, n in mates:
            qs.append(self.mate_q[i][s : s + n])
            counts.append(n)
            starts.append(s)
            tables.append(self.mate_tables[i])
        qs.append((self.q if q is None else q)[start : start + count])
        counts.append(count)
        starts.append(start)
        tables.append(self.table)
        meta = build_attention_meta(counts, starts, tables).to(DEV)
        out = latent_attention(torch.cat(qs), self.cache, meta, SCALE, DL, cfg, path,
                               torch.float32)  # fmt: skip
        return out[sum(counts[:-1]) :]

    def reference(self) -> torch.Tensor:
        rows = self.cache[torch.tensor(self.table, device=DEV), 0].double()
        s = torch.einsum("qhw,kw->hqk", self.q.double(), rows) * SCALE
        s = s.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool, device=DEV).triu(1), -torch.inf)
        return torch.einsum("hqk,kd->qhd", s.softmax(-1), rows[:, :DL])


@pytest.fixture(scope="module")
def pool() -> LatentPool:
    return LatentPool(seed=200)


@pytest.fixture(scope="module")
def full(pool: LatentPool) -> torch.Tensor:
    return pool.run(0, SEQ, path="prefill")


def test_matches_reference_and_the_cpu_kernel(pool: LatentPool, full: torch.Tensor) -> None:
    ref = pool.reference()
    assert float((full.double() - ref).norm() / ref.norm()) < TOL
    meta = build_attention_meta([SEQ], [0], [pool.table])
    cpu = CpuDeterministicOps().latent_attention(
        pool.q.cpu().float(), pool.cache.cpu().float(), meta, SCALE, DL
    )
    assert float((full.cpu() - cpu).abs().max()) < (5e-2 if GPU else 1e-5)


def test_chunked_prefill_and_decode_on_every_path_match_the_prefill(
    pool: LatentPool, full: torch.Tensor
) -> None:
    """Chunks at every prefix offset (interpreter; a sample on the GPU) on the path of each
    cut; one-row decodes on the wrapper's path and on fold and split forced."""
    offsets = range(SEQ) if not GPU else sorted({*range(0, 70), *range(200, 320, 3),
                                                 *range(500, SEQ, 11)})  # fmt: skip
    for p in offsets:
        n = min(SEQ - p, 1 + p % 7)
        path = ("prefill", "split", "fold", None)[p % 4]
        assert torch.equal(pool.run(p, n, path=path), full[p : p + n]), (p, n, path)
        for decode in (None, "fold", "split"):
            assert torch.equal(pool.run(p, 1, path=decode), full[p : p + 1]), (p, decode)


def test_batch_mates_and_waves_do_not_matter(pool: LatentPool, full: torch.Tensor) -> None:
    rng = random.Random(5)
    for trial in range(6):
        mates = []
        for i, n in enumerate(pool.mate_lens):
            s = rng.randrange(n)
            mates.append((i, s, rng.randint(1, min(n - s, 9))))
        rng.shuffle(mates)
        p = rng.randrange(SEQ)
        n = rng.randint(1, min(SEQ - p, 9))
        path = ("prefill", "split", "fold")[trial % 3]
        assert torch.equal(pool.run(p, n, mates, path=path), full[p : p + n]), (trial, p, n)
    tiny = replace(CFG, workspace_bytes=1)  # one split per wave: the waves fold in order
    assert torch.equal(pool.run(SEQ - 3, 3, cfg=tiny, path="split"), full[SEQ - 3 :])


def test_value_column_chunks_and_tile_rows_change_no_bit(
    pool: LatentPool, full: torch.Tensor
) -> None:
    """Prefill tiles of other value-column chunks and other row counts (on the GPU those
    that fit its shared memory: 128 rows x 512 columns does not)."""
    if GPU:
        cfgs = [replace(CFG, value_cols=128), replace(CFG, rows=64, value_cols=512, num_stages=2)]
    else:
        cfgs = [replace(CFG, value_cols=c) for c in (16, DL // 2, DL)] + [replace(CFG, rows=16)]
    for cfg in cfgs:
        assert torch.equal(pool.run(0, SEQ, cfg=cfg, path="prefill"), full), cfg


def test_negative_controls_the_bit_checks_can_fail(pool: LatentPool, full: torch.Tensor) -> None:
    """Another split size, another key block, and one perturbed query element each change
    bits that the checks above compare, so their equalities are not vacuous."""
    for bad in (replace(CFG, split=2 * CFG.split), replace(CFG, block_n=2 * CFG.block_n)):
        rows = torch.cat([pool.run(p, 1, cfg=bad, path="split") for p in range(0, SEQ, 3)])
        assert not torch.equal(rows, full[0:SEQ:3]), bad
    q = pool.q.clone()
    q[SEQ - 1, 0, 0] += 0.25  # one query element of the last row (a step bf16 keeps)
    assert not torch.equal(pool.run(SEQ - 1, 1, q=q), full[SEQ - 1 :])
    assert torch.equal(pool.run(SEQ - 2, 1, q=q), full[SEQ - 2 : SEQ - 1])


def test_heads_that_straddle_tiles_and_64_bit_offsets_change_no_bit(monkeypatch) -> None:
    """5 heads (GLM-4.7-Flash's 20 on the GPU): tiles of 16 rows hold heads of two or more
    positions, cut at other places in prefill chunks and decodes. And 64-bit offsets (a
    cache past 2**31 elements, e.g. an FP8 latent pool of 5.8M tokens) forced on every path:
    the same bits."""
    import lockstep.ops.triton.latent_attention as kernel

    pool = LatentPool(seed=202, heads=20 if GPU else 5)
    full = pool.run(0, SEQ, path="prefill")
    rng = random.Random(11)
    for p in sorted(rng.sample(range(SEQ), 10)):
        n = min(SEQ - p, rng.randint(1, 6))
        mates = [(0, 0, min(pool.mate_lens[0], 3))]
        assert torch.equal(pool.run(p, n, mates, path="prefill"), full[p : p + n]), (p, n)
        for decode in ("fold", "split"):
            assert torch.equal(pool.run(p, 1, mates, path=decode), full[p : p + 1]), (p, decode)
    monkeypatch.setattr(kernel, "needs_wide_offsets", lambda cache: True)
    assert torch.equal(pool.run(0, SEQ, path="prefill"), full)
    for decode in ("fold", "split"):
        assert torch.equal(pool.run(SEQ - 1, 1, path=decode), full[SEQ - 1 :]), decode


def test_fp8_cache_widens_exactly() -> None:
    """An e4m3 cache gives the bits of the same values held in q's dtype (bfloat16 on the
    GPU, whose widening scales and unscales by powers of two; float32 in the interpreter)."""
    pool = LatentPool(seed=201, mates=0)
    e4m3 = pool.cache.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    meta = build_attention_meta([SEQ], [0], [pool.table]).to(DEV)
    got = latent_attention(pool.q, e4m3, meta, SCALE, DL, CFG, "prefill", torch.float32)
    want = latent_attention(pool.q, e4m3.to(DTYPE), meta, SCALE, DL, CFG, "prefill",
                            torch.float32)  # fmt: skip
    assert torch.equal(got, want)
    dec = latent_attention(pool.q[SEQ - 1 :], e4m3, build_attention_meta(
        [1], [SEQ - 1], [pool.table]).to(DEV), SCALE, DL, CFG, "split", torch.float32)  # fmt: skip
    assert torch.equal(dec, got[SEQ - 1 :])


# ------------------------------------------------------------------------- DeepSeek routing


def _moe_layer(e: int, k: int, routing: DeepseekRouting, renormalize: bool) -> MoeLayer:
    empty = torch.zeros(e, 1, 1)
    return MoeLayer(torch.zeros(e, 1), empty, empty, k, renormalize, deepseek=routing)


ROUTINGS = [  # (experts, top_k, renormalize, routing): V3-like, V2-Lite-like, GLM-like
    (64, 8, True, ("sigmoid", True, 8, 4, "top2_sum", 2.5)),
    (64, 6, False, ("softmax", False, 1, 1, "max", 1.0)),
    (48, 4, True, ("sigmoid", True, 1, 1, "max", 1.8)),
    (32, 3, True, ("softmax", False, 4, 2, "max", 1.0)),
]


@pytest.mark.parametrize("case", ROUTINGS)
def test_deepseek_routing_matches_the_cpu_backend_ties_included(case) -> None:
    """Experts equal the CPU backend's (ties toward the lower id: rows of repeated logits and
    whole tied groups), weights within float32 rounding; a row routed alone has the bits it
    has in the batch. Negative control: with ties broken toward the higher id (the same
    routing of the logits' mirror image) the tied rows choose differently."""
    e, k, renormalize, (scoring, bias, groups, topk_groups, group_score, scaling) = case
    g = torch.Generator().manual_seed(e + k)
    logits = torch.randn(40, e, generator=g)
    logits[:10] = torch.randint(-2, 3, (10, e), generator=g).float()  # many exact ties
    logits[10:14] = 0.5  # every expert tied
    correction = torch.rand(e, generator=g) * 0.1 if bias else None
    if correction is not None:  # tie the biases pairwise so that choice scores tie too
        correction[1::2] = correction[0::2]
    r = DeepseekRouting(scoring, correction, groups, topk_groups, group_score, scaling)
    layer = _moe_layer(e, k, r, renormalize)
    want = CpuDeterministicOps().route_deepseek(logits, layer)
    gpu_layer = _moe_layer(e, k, replace(r, correction_bias=None if correction is None else
                                         correction.to(DEV)), renormalize)  # fmt: skip
    ops = GpuDeterministicOps()
    got = ops.route_deepseek(logits.to(DEV), gpu_layer)
    assert torch.equal(got.experts.cpu(), want.experts)
    assert torch.allclose(got.weights.cpu(), want.weights, rtol=1e-6, atol=1e-7)
    for row in (0, 11, 39):
        alone = ops.route_deepseek(logits[row : row + 1].to(DEV), gpu_layer)
        assert torch.equal(alone.experts, got.experts[row : row + 1])
        assert torch.equal(alone.weights, got.weights[row : row + 1])
    mirror_bias = None if correction is None else correction.flip(0).to(DEV)
    mirror = ops.route_deepseek(logits.flip(1).to(DEV), _moe_layer(
        e, k, replace(r, correction_bias=mirror_bias), renormalize))  # fmt: skip
    assert not torch.equal((e - 1 - mirror.experts).cpu()[:14], want.experts[:14])
    assert torch.equal((e - 1 - mirror.experts).cpu()[14:].sort(1).values,
                       want.experts[14:].sort(1).values)  # fmt: skip


def test_widths_the_kernel_cannot_take_are_refused_at_load() -> None:
    """A latent of 48 values (a multiple of 16, which the family accepts, not a power of two)
    is refused by the Triton backend at load, in one line naming kv_lora_rank, not at the
    first request; the CPU backend loads and runs the same model (the control)."""
    from lockstep.errors import ModelLoadError
    from lockstep.models.decoder import Decoder
    from lockstep.models.presets import PRESETS, RandomWeights, byte_tokenizer
    from lockstep.models.resolver import LoadedModel

    spec = PRESETS["tiny-deepseek-v3"].spec
    assert spec.mla is not None and spec.mla.kv_lora_rank == 64
    odd = replace(spec, mla=replace(spec.mla, kv_lora_rank=48))
    loaded = LoadedModel("odd", "random:odd", odd, byte_tokenizer(odd.vocab_size, False),
                         RandomWeights(odd, 0))  # fmt: skip
    with pytest.raises(ModelLoadError) as err:
        Decoder.load(loaded, GpuDeterministicOps(), torch.float32, "cpu")
    message = str(err.value)
    assert "kv_lora_rank=48" in message and "power of two" in message and "\n" not in message
    decoder = Decoder.load(loaded, CpuDeterministicOps(), torch.float32, "cpu")
    assert torch.isfinite(decoder.logits_for_sequence([5, 9, 300])).all()
