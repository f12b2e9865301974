"""The GPU MoE kernels (`lockstep/ops/triton/moe.py`) under the Triton interpreter, tiny shapes:
routing ties toward the lower expert id, the layer against the float64 reference, the fused
path equal to the unfused one (matmul, silu_mul, matmul, rank-order combine) bit for bit, and
a token's bits independent of how many tokens its experts received and of the tile config.
Negative controls: another K block changes the bits (the check sees the K order), and the
stock loop over experts on torch's CPU GEMM changes a token's bits with its experts' load.

The interpreter's tl.dot is replaced by a row-local one (tests/kernels/test_ops_triton.py explains
why), so that bit equality tests the kernels' logic. On a GPU machine the same file runs the
kernels compiled (tests/gpu/test_gpu_moe.py has the H200 shapes)."""

from __future__ import annotations

import random

import pytest
import test_ops_triton  # noqa: F401  (installs the row-local interpreter dot on CPU machines)
import torch
import torch.nn.functional as F

from lockstep.ops.float64 import Float64Ops
from lockstep.ops.gpu_deterministic import GpuDeterministicOps
from lockstep.ops.moe import (
    MoeLayer,
    combine_in_rank_order,
    experts_dense,
    experts_grouped,
    prepare_expert_weights,
    route_sorted,
)
from lockstep.ops.triton import moe as gm

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
E, TOP_K, H, INTER = 6, 2, 32, 48  # INTER = 48: K blocks of 32 end inside the down's K
# One K block covers K (32 and 48), as in the dense matmul's tiny-shape configs, so that the
# interpreter's block roundings agree with `linear`'s; OTHER_K cuts K into blocks of 16.
SMALL = gm.GroupedConfig(16, 16, 64, 4, 1)
WIDE = gm.GroupedConfig(32, 32, 64, 4, 1)
OTHER_K = gm.GroupedConfig(16, 16, 16, 4, 1)


@pytest.fixture(scope="module")
def ops() -> GpuDeterministicOps:
    return GpuDeterministicOps()


def raw_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(E, H, generator=g) / H**0.5,
        "gate_up": torch.randn(E, 2 * INTER, H, generator=g) / H**0.5,
        "down": torch.randn(E, H, INTER, generator=g) / INTER**0.5,
    }


def layer_for(backend, raw: dict[str, torch.Tensor], renormalize: bool = True) -> MoeLayer:
    prep = backend.prepare_linear_weight
    dtype = torch.float64 if isinstance(backend, Float64Ops) else DTYPE
    dev = "cpu" if isinstance(backend, Float64Ops) else DEV
    w = {k: v.to(dev, dtype) for k, v in raw.items()}
    return MoeLayer(prep(w["router"]), prepare_expert_weights(prep, w["gate_up"]),
                    prepare_expert_weights(prep, w["down"]), TOP_K, renormalize)  # fmt: skip


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).to(DEV, DTYPE)


def test_route_ties_go_to_the_lower_expert_id() -> None:
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 0.0, 0.0],
            [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0],
            [9.0, 1.0, 4.0, 1.0, 4.0, 1.0, 1.0, 4.0],
        ],
        device=DEV,
    )
    expected = {
        1: [[1], [0], [6], [0]],
        2: [[1, 2], [0, 1], [6, 7], [0, 2]],
        3: [[1, 2, 4], [0, 1, 2], [6, 7, 0], [0, 2, 4]],
    }
    for k, ids in expected.items():
        for renormalize in (True, False):
            got = gm.route(logits, k, renormalize)
            assert got.experts.tolist() == ids, (k, renormalize)
            want = route_sorted(logits, k, renormalize)
            # tl.exp is exp2 of x * log2(e) on the GPU: a few ulp from torch.exp
            torch.testing.assert_close(got.weights, want.weights, rtol=1e-5, atol=1e-6)


def test_grouping_kernel_equals_the_stable_sort() -> None:
    """Both grouping paths (one program up to 128 slots, blocks above) give the stable
    sort's order and offsets, experts without slots and all slots on one expert included."""
    g = torch.Generator().manual_seed(11)
    cases = [(1, 8), (8, 128), (37, 6), (128, 128), (128, 3), (129, 6), (300, 6), (2500, 128)]
    for slots, experts in [*cases, (300, 1)]:
        ids = torch.randint(0, experts, (slots,), generator=g).to(DEV)
        order, offsets = gm.group_slots(ids, experts)
        sorted_ids, want = torch.sort(ids, stable=True)
        bounds = torch.arange(experts + 1, device=DEV)
        assert torch.equal(order, want), (slots, experts)
        assert torch.equal(offsets, torch.searchsorted(sorted_ids, bounds)), (slots, experts)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_row_leaves_its_batch_mates_bits(ops, bad) -> None:
    """A row of NaN (or inf, whose router logits are NaN) is routed to real experts and
    changes no other row, in both grouping paths (one program, blocks). Such rows exist: a
    hybrid model's CUDA-graph padding rows run from the state pool's scratch slot, whose
    contents nobody keeps finite. An expert id past E would give the grouping a position
    another slot owns, and a real token would read a row no GEMM wrote."""
    layer = layer_for(ops, raw_weights(6))
    for n in (9, 70):  # 18 slots: the one-program grouping; 140: the block kernels
        x = tokens(n, 12)
        bad_rows = [0, 3, n - 1]
        x_bad = x.clone()
        x_bad[bad_rows] = bad
        keep = [i for i in range(n) if i not in bad_rows]
        assert torch.equal(gm.moe(x_bad, layer)[keep], gm.moe(x, layer)[keep]), n
        routing = gm.route(gm.router_logits(x_bad, layer), TOP_K, True)
        assert ((routing.experts >= 0) & (routing.experts < E)).all(), routing.experts[bad_rows]


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_matches_the_float64_reference(ops, renormalize) -> None:
    raw = raw_weights(1)
    x = tokens(23, 2)
    expected = Float64Ops().moe(x.cpu().double(), layer_for(Float64Ops(), raw, renormalize))
    assert expected.abs().max() > 0.1
    out = ops.moe(x, layer_for(ops, raw, renormalize))  # the tables' configs
    assert out.shape == (23, H) and out.dtype == DTYPE
    tol = 2e-2 if GPU else 1e-5
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol)


def test_fused_path_equals_the_unfused_composition(ops) -> None:
    """The grouped GEMM with SiLU in its epilogue and the combine kernel give the bits of the
    dense composition: every expert's `linear`, `silu_mul`, `linear`, then
    `combine_in_rank_order` rounded once."""
    layer = layer_for(ops, raw_weights(3))
    x = tokens(19, 4)
    routing = gm.route(gm.router_logits(x, layer), TOP_K, True)
    dense = experts_dense(x, routing.experts, layer, ops.linear, ops.silu_mul)
    want = combine_in_rank_order(dense, routing.weights).to(x.dtype)
    for cfg in (SMALL, WIDE):
        assert torch.equal(gm.moe(x, layer, cfg, cfg), want), cfg


def _probe_rows(layer: MoeLayer, loads: list[int], run) -> list[int]:
    """The loads at which a probe token's output row differs from its row alone. Load L:
    the probe beside L - 1 copies of itself (its experts get L rows each, checked) and 5
    other tokens, at a random row."""
    rng = random.Random(7)
    probe = tokens(1, 8)
    alone = run(probe)
    experts = set(gm.route(gm.router_logits(probe, layer), TOP_K, True).experts[0].tolist())
    changed = []
    for load in loads:
        mates = probe.expand(load - 1, H)
        others = tokens(5, 100 + load)
        rows = [*mates, *others]
        at = rng.randrange(len(rows) + 1)
        batch = torch.stack([*rows[:at], probe[0], *rows[at:]])
        routed = gm.route(gm.router_logits(batch, layer), TOP_K, True)
        same = sum(set(r) == experts for r in routed.experts.tolist())
        assert same >= load, f"only {same} of {load} copies kept the probe's experts"
        if not torch.equal(run(batch)[at : at + 1], alone):
            changed.append(load)
    return changed


LOADS = [1, 2, 17, 40]


def test_a_tokens_bits_ignore_its_experts_load_and_the_tile_config(ops) -> None:
    layer = layer_for(ops, raw_weights(5))
    assert _probe_rows(layer, LOADS, lambda x: gm.moe(x, layer, SMALL, SMALL)) == []
    assert _probe_rows(layer, LOADS, lambda x: ops.moe(x, layer)) == []  # the tables
    probe = tokens(3, 8)
    assert torch.equal(gm.moe(probe, layer, SMALL, SMALL), gm.moe(probe, layer, WIDE, WIDE))


def test_negative_control_another_k_block_changes_the_bits(ops) -> None:
    """BK 16 vs 64 adds K in other blocks (with the row-local dot, a block is one rounding):
    the bit checks above can see a changed K order."""
    if GPU:
        pytest.skip("on the GPU a K block is a chain of MMAs; the interpreter sees the order")
    layer = layer_for(ops, raw_weights(5))
    x = tokens(9, 10)
    assert not torch.equal(gm.moe(x, layer, SMALL, SMALL), gm.moe(x, layer, OTHER_K, OTHER_K))


def test_negative_control_the_stock_loop_changes_with_the_load(ops) -> None:
    """The stock loop over experts on torch's GEMM (M-dependent on the CPU and in cuBLAS)
    changes the probe's bits with its experts' load: the load check is not blind."""
    if GPU:
        pytest.skip(
            "cuBLAS keeps these tiny shapes' bits; tests/gpu/test_gpu_moe.py has the GPU control"
        )
    layer = layer_for(ops, raw_weights(5))

    def stock(x: torch.Tensor) -> torch.Tensor:
        routing = route_sorted(F.linear(x, layer.router).float(), TOP_K, True)
        slots = experts_grouped(x, routing.experts, layer, F.linear, ops.silu_mul)
        return combine_in_rank_order(slots, routing.weights).to(x.dtype)

    assert _probe_rows(layer, LOADS, stock)
