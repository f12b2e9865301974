"""Mixture of experts on the CPU: `Ops.moe` against the float64 reference, top-k ties toward
the lower expert id on every routing path, a token's output bits independent of how many
tokens its experts received (with the stock implementation as the negative control), the
routing kernel's SIMD paths and thread counts, and the tiny Qwen3-MoE preset end to end
through `LLM`, its presets and its weight updates."""

from __future__ import annotations

import random

import pytest
import torch

from lockstep import LLM, SamplingParams
from lockstep.models.blocks import expected_weight_names
from lockstep.models.presets import PRESETS
from lockstep.models.resolver import resolve_model
from lockstep.ops.cpu_deterministic import CpuDeterministicOps
from lockstep.ops.cpu_stock import CpuStockOps
from lockstep.ops.float64 import Float64Ops
from lockstep.ops.moe import MoeLayer, prepare_expert_weights, route_sorted

E, TOP_K, H, INTER = 8, 2, 128, 40  # INTER is not a multiple of the CPU's 16 lanes


@pytest.fixture(scope="module")
def det() -> CpuDeterministicOps:
    return CpuDeterministicOps()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def raw_weights(seed: int, experts: int = E) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(experts, H, generator=g) / H**0.5,
        "gate_up": torch.randn(experts, 2 * INTER, H, generator=g) / H**0.5,
        "down": torch.randn(experts, H, INTER, generator=g) / INTER**0.5,
    }


def layer_for(ops, raw: dict[str, torch.Tensor], renormalize: bool = True,
              dtype: torch.dtype = torch.float32, top_k: int = TOP_K) -> MoeLayer:  # fmt: skip
    """The layer as `Decoder.load` prepares it for `ops`."""
    prepare = ops.prepare_linear_weight
    return MoeLayer(
        router=prepare(raw["router"].to(dtype)),
        gate_up=prepare_expert_weights(prepare, raw["gate_up"].to(dtype)),
        down=prepare_expert_weights(prepare, raw["down"].to(dtype)),
        top_k=top_k,
        renormalize=renormalize,
    )


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_matches_the_float64_reference(det, renormalize, dtype) -> None:
    raw = {k: v.to(dtype) for k, v in raw_weights(1).items()}  # both read the same roundings
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(2))
    expected = Float64Ops().moe(x, layer_for(Float64Ops(), raw, renormalize))
    assert expected.abs().max() > 0.1
    for ops in (det, CpuStockOps()):
        out = ops.moe(x, layer_for(ops, raw, renormalize, dtype))
        assert out.shape == (37, H) and out.dtype == torch.float32
        close(out, expected, 1e-5)


def test_renormalization_changes_the_output(det) -> None:
    """The flag reaches the routing (with top 2 of 8 the two weightings differ)."""
    raw = raw_weights(1)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    on, off = (det.moe(x, layer_for(det, raw, flag)) for flag in (True, False))
    assert (on - off).abs().max() > 1e-2


# ----------------------------------------------------------------------------- ties


def test_moe_route_ties_go_to_the_lower_expert_id(det) -> None:
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 0.0, 0.0],  # three equal maxima
            [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],  # all equal
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0],  # equal at the end
            [9.0, 1.0, 4.0, 1.0, 4.0, 1.0, 1.0, 4.0],  # equal after a clear first
        ]
    )
    expected = {
        2: [[1, 2], [0, 1], [6, 7], [0, 2]],
        3: [[1, 2, 4], [0, 1, 2], [6, 7, 0], [0, 2, 4]],
    }
    for k, ids in expected.items():
        got, weights = det._ext.moe_route(logits, k, True, 0)
        assert got.tolist() == ids, k
        assert torch.equal(route_sorted(logits, k, True).experts, got), k
        assert torch.allclose(weights.sum(dim=1), torch.ones(4))


@pytest.mark.parametrize("ops_name", ["cpu_deterministic", "reference"])
def test_a_tied_router_picks_the_lower_expert_id(det, ops_name) -> None:
    """Experts 2 and 5 have the same router row, so every token's logits for them are equal
    bit for bit, and they rank first and second. Expert 5's weights are NaN: a routing that
    broke the tie toward 5 with top 1 would output NaN (the check can fail), and with top 2
    it must give NaN (5 is chosen second)."""
    ops = det if ops_name == "cpu_deterministic" else Float64Ops()
    raw = raw_weights(3)
    g = torch.Generator().manual_seed(4)
    direction = torch.randn(H, generator=g)
    direction /= direction.norm()
    x = torch.randn(6, H, generator=g) + 5.0 * direction  # every token leans toward it
    raw["router"][2] = raw["router"][5] = 10.0 * direction
    raw["gate_up"][5] = raw["down"][5] = float("nan")
    layer = layer_for(ops, raw, top_k=1)
    logits = ops.linear(x, layer.router)
    assert torch.equal(logits[:, 2], logits[:, 5])  # a real tie
    assert (logits[:, 2:3] > logits[:, [0, 1, 3, 4, 6, 7]]).all()  # for first place
    out = ops.moe(x, layer)
    assert not out.isnan().any()
    only_two = raw_weights(3)  # expert 2 alone: the same output
    only_two["router"] = raw["router"].clone()
    only_two["router"][5] = -only_two["router"][5]
    assert torch.equal(out, ops.moe(x, layer_for(ops, only_two, top_k=1)))
    assert ops.moe(x, layer_for(ops, raw, top_k=2)).isnan().all()


# ----------------------------------------------------------------------------- invariance


def _probe_among_mates(ops, layer: MoeLayer, probe: torch.Tensor, loads: list[int], seed: int):
    """For each load L: the probe token beside L-1 near copies of itself (routed to the same
    experts, checked) and 7 random tokens, at a random row. Yields (L, the probe's output
    row, the probe experts' token counts)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    det = CpuDeterministicOps()
    probe_experts = set(
        det._ext.moe_route(det.linear(probe, layer.router), TOP_K, True, 0)[0][0].tolist()
    )
    for load in loads:
        mates = probe + 1e-3 * torch.randn(load - 1, H, generator=g)
        x = torch.cat([mates, torch.randn(7, H, generator=g)])
        at = rng.randrange(x.shape[0] + 1)
        x = torch.cat([x[:at], probe, x[at:]])
        routed = det._ext.moe_route(det.linear(x, layer.router), TOP_K, True, 0)[0]
        counts = [int((routed == e).sum()) for e in sorted(probe_experts)]
        yield load, ops.moe(x, layer)[at : at + 1], counts


LOADS = [1, 2, 3, 4, 5, 7, 8, 16, 33, 100, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_bits_do_not_depend_on_its_experts_load(det, dtype) -> None:
    """The same token routed with 1 to ~300 tokens to each of its experts keeps its bits (the
    expert linears cross the CPU kernel's 4-row tiles, 64-row chunks and, in bf16, the
    32-row widened panels)."""
    layer = layer_for(det, raw_weights(5), dtype=dtype)
    probe = torch.randn(1, H, generator=torch.Generator().manual_seed(6))
    alone = det.moe(probe, layer)
    for load, row, counts in _probe_among_mates(det, layer, probe, LOADS, seed=7):
        assert min(counts) >= load, (load, counts)
        assert torch.equal(row, alone), f"load {load}: max |delta| {(row - alone).abs().max()}"


def test_negative_control_stock_moe_bits_depend_on_the_load() -> None:
    """The same check on the stock implementation (torch GEMM rows change with M) fails."""
    stock = CpuStockOps()
    layer = layer_for(stock, raw_weights(5))
    probe = torch.randn(1, H, generator=torch.Generator().manual_seed(6))
    alone = stock.moe(probe, layer)
    changed = [load for load, row, _ in _probe_among_mates(stock, layer, probe, LOADS, seed=7)
               if not torch.equal(row, alone)]  # fmt: skip
    assert changed, "stock MoE kept every bit at every load: the check is blind"


def test_moe_route_same_bits_on_every_simd_path_and_thread_count(det, threads) -> None:
    logits = torch.randn(70, 37, generator=torch.Generator().manual_seed(8)) * 3
    logits[5, 10] = logits[5, 11] = logits[5].max() + 1  # a tie in a long row's body
    results = []
    for name in det._ext.simd_variants():
        ops = CpuDeterministicOps(simd=name)
        for n in (1, 2):
            torch.set_num_threads(n)
            for renormalize in (True, False):
                results.append(ops._ext.moe_route(logits, 5, renormalize, ops._simd))
    assert len(results) >= 4 and results[0][0].dtype == torch.int64
    for i, (ids, weights) in enumerate(results):  # (simd, threads, renormalize) order
        ids0, weights0 = results[i % 2]
        assert torch.equal(ids, ids0) and torch.equal(weights, weights0), i
    assert not torch.equal(results[0][1], results[1][1])  # the two formulas do differ


# ----------------------------------------------------------------------------- models


def test_the_30b_preset_builds_its_spec_and_names_without_weights() -> None:
    """random:qwen3-30b-a3b resolves from metadata alone (its weights would be 61 GB in
    float16): Qwen3-30B-A3B's shapes, parameter count and tensor names."""
    loaded = resolve_model("random:qwen3-30b-a3b")
    spec, moe = loaded.spec, loaded.spec.moe
    assert spec.family == "qwen3_moe" and moe is not None
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (
        128, 8, 768, True,
    )  # fmt: skip
    assert moe.sparse_layers == tuple(range(48))
    assert round(spec.num_parameters / 1e9, 2) == 30.53
    names = loaded.weight_names()
    assert names == expected_weight_names(spec) and len(names) == 48 * (9 + 3 * 128) + 3
    assert "model.layers.47.mlp.experts.127.down_proj.weight" in names
    assert not any(n.startswith("model.layers.0.mlp.gate_proj") for n in names)


def test_tiny_moe_preset_weights() -> None:
    loaded = resolve_model("random:tiny-qwen3-moe")
    assert loaded.spec == PRESETS["tiny-qwen3-moe"].spec
    router = loaded.weights.tensor("model.layers.1.mlp.gate.weight", torch.float32, "cpu")
    down = loaded.weights.tensor("model.layers.1.mlp.experts.7.down_proj.weight",
                                 torch.float32, "cpu")  # fmt: skip
    assert router.shape == (8, 128) and down.shape == (128, 64)
    assert abs(down.std().item() * 64**0.5 - 1.0) < 0.05  # N(0, 1/fan_in) like every projection


PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of"]


def test_llm_runs_the_tiny_moe_preset_end_to_end() -> None:
    """Text in, text out through the scheduler, KV pool and prefix cache; each request gives
    the same tokens and logprobs alone as beside the others, and again from the cache."""
    llm = LLM("random:tiny-qwen3-moe", device="cpu", kv_tokens=2048, max_batch_tokens=64,
              chunk_size=16)  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, logprobs=1)
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.token_ids) == 12 and o.text for o in together)
    for prompt, out in zip(PROMPTS, together, strict=True):
        llm.engine.flush_cache()
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert (alone.token_ids, alone.logprobs) == (out.token_ids, out.logprobs), prompt
        cached = llm.generate([prompt], params, use_tqdm=False)[0]
        assert cached.cached_tokens > 0 and cached.token_ids == out.token_ids
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))
    assert len(chat.token_ids) >= 1
    llm.engine.check_integrity()
