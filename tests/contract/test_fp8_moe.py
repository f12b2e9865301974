"""Block-FP8 mixture of experts on the CPU: a tiny Qwen3-MoE folder quantized as
Qwen3-30B-A3B-FP8 is (tests/support/tiny_fp8.py) loads with its experts in FP8 and its routers
unquantized, gives the logits of an independent float64 reference of the quantized model,
and keeps the contract (random schedules equal one cold prefill, with the bf16 and the FP8
KV cache). A token's expert GEMM row is the dense FP8 linear's row, and its MoE output
does not depend on its batch-mates. Negative controls: reference mode, and the deterministic
backend with only its MoE op replaced by the stock loop, fail the same checks."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_position_invariance import (  # noqa: E402
    _batch_invariance_failures,
    _check_case,
    _engine,
)

from lockstep.config import EngineConfig  # noqa: E402
from lockstep.engine.engine import Engine  # noqa: E402
from lockstep.errors import ModelLoadError  # noqa: E402
from lockstep.models.decoder import Decoder  # noqa: E402
from lockstep.models.presets import PRESETS  # noqa: E402
from lockstep.models.resolver import resolve_model  # noqa: E402
from lockstep.models.spec import Fp8Spec  # noqa: E402
from lockstep.ops import get_ops  # noqa: E402
from lockstep.ops.cpu_deterministic import CpuDeterministicOps  # noqa: E402
from lockstep.ops.cpu_stock import CpuStockOps  # noqa: E402
from lockstep.ops.fp8 import quantize_weight  # noqa: E402
from lockstep.ops.moe import MoeLayer, prepare_fp8_experts  # noqa: E402
from tests.support.tiny_fp8 import edit_tensors, float64_reference, write_fp8_folder  # noqa: E402

TOKENS = [5, 17, 200, 33, 91, 7, 150, 64, 2, 250, 11, 99]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("fp8-moe")
    model = write_fp8_folder(path, "fp8-block", family="qwen3_moe")
    return path, model


def test_fp8_moe_folder_matches_float64_reference(folder) -> None:
    path, model = folder
    loaded = resolve_model(str(path))
    decoder = Decoder.load(loaded, get_ops("cpu", "deterministic"), torch.float32, "cpu")
    moe = decoder.layers[0].mlp.layer
    assert moe.fp8 and decoder.layers[0].mlp.router.dtype == torch.float32  # router kept
    # gate's 2 row blocks (160 = 128 + 32), then up's; 2 K blocks (192 = 128 + 64)
    assert tuple(moe.gate_up_scale.shape) == (8, 4, 2)
    assert tuple(moe.down_scale.shape) == (8, 2, 2)
    got = decoder.logits_for_sequence(TOKENS).double()
    model.config._experts_implementation = "eager"  # torch's grouped_mm takes no float64
    with torch.no_grad():
        plain = model.to(torch.float64)(torch.tensor([TOKENS])).logits[0]
        want = float64_reference(model, path, "fp8-block")(torch.tensor([TOKENS])).logits[0]
    assert (got - want).abs().max().item() <= 1e-5
    # The control: the unquantized model is far from the quantized one at this tolerance.
    assert (got - plain).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "cache"),
    [("bfloat16", "auto", torch.bfloat16), ("float32", "fp8_e4m3", torch.float8_e4m3fn)],
)  # fmt: skip
def test_fp8_moe_folder_any_schedule_matches_cold_prefill(
    folder, dtype: str, kv_dtype: str, cache: torch.dtype
) -> None:
    """The property suite with the bf16 KV cache (a bf16 engine: router and embeddings bf16
    too) and the FP8 one, the caches the issue names; the experts' arithmetic does not
    depend on the cache's dtype."""
    config = EngineConfig(model=str(folder[0]), device="cpu", dtype=dtype, kv_dtype=kv_dtype,
                          kv_tokens=4096)  # fmt: skip
    engine = Engine(config)
    assert engine.pool.k_cache(0).dtype == cache
    assert engine.decoder.layers[0].mlp.layer.gate_up.dtype == torch.float32  # dequantized
    for seed in range(3):
        _check_case(engine, seed, max_len=64, max_mates=3)


def test_negative_control_reference_mode_breaks_fp8_moe_invariance(folder) -> None:
    assert _batch_invariance_failures(_engine(str(folder[0]), mode="reference")) > 0


def test_negative_control_stock_fp8_moe_breaks_invariance(folder) -> None:
    """Deterministic everything but the MoE op (transformers' loop of torch GEMMs over each
    expert's tokens, FP8 experts dequantized): the property fails, so it sees the experts."""

    class StockMoe(CpuDeterministicOps):
        def moe(self, x, layer):
            return CpuStockOps.moe(CpuStockOps(), x, layer)

    engine = _engine(str(folder[0]))
    engine.decoder.ops = StockMoe()
    assert _batch_invariance_failures(engine) > 0, "stock FP8 MoE passed: the check is blind"


def _fp8_layer(
    ops, seed: int, experts: int = 4, h: int = 192, inter: int = 256
) -> tuple[MoeLayer, dict]:
    """A block-FP8 layer as `Decoder.load` prepares it for `ops`, from random weights, and
    the quantized parts it holds ((expert, "gate" | "up" | "down") -> (e4m3, scales, None))."""
    g = torch.Generator().manual_seed(seed)
    parts = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    quantized = {
        (e, p): quantize_weight(torch.randn(*shape, generator=g) / shape[1] ** 0.5, "block")
        for e in range(experts) for p, shape in parts.items()
    }  # fmt: skip

    def stacked(names: tuple[str, ...]):
        w = [quantized[e, p][0] for e in range(experts) for p in names]
        s = [quantized[e, p][1] for e in range(experts) for p in names]
        return prepare_fp8_experts(ops.prepare_fp8_linear, w, s, experts)

    gate_up, down = stacked(("gate", "up")), stacked(("down",))
    router = ops.prepare_linear_weight(torch.randn(experts, h, generator=g) / h**0.5)
    layer = MoeLayer(router, gate_up.weight, down.weight, 2, True, gate_up.scale, down.scale)
    return layer, quantized


def test_expert_gemm_row_equals_the_dense_fp8_linear_row() -> None:
    """Expert e's gate | up and down GEMMs give the dense FP8 linear's bits over the same
    e4m3 weights and scales (the dense path fuses gate | up by 128-row blocks)."""
    ops = CpuDeterministicOps()
    layer, q = _fp8_layer(ops, 1)
    x = torch.randn(9, 192, generator=torch.Generator().manual_seed(2))
    for e in range(layer.num_experts):
        dense = ops.prepare_fp8_linear(
            "block", torch.cat([q[e, "gate"][0], q[e, "up"][0]]),
            torch.cat([q[e, "gate"][1], q[e, "up"][1]]), None,
        )  # fmt: skip
        want = ops.fp8_linear(x, dense)
        assert torch.equal(ops.fp8_expert_linear(x, layer.gate_up[e]), want)
        h = ops.silu_mul(want)
        down = ops.prepare_fp8_linear("block", q[e, "down"][0], q[e, "down"][1], None)
        assert torch.equal(ops.fp8_expert_linear(h, layer.down[e]), ops.fp8_linear(h, down))


def test_a_tokens_fp8_moe_row_ignores_its_batch_mates() -> None:
    """Each token's row of one call of 40 equals the token alone; the stock loop (the
    control) changes some row's bits with the batch."""
    det, stock = CpuDeterministicOps(), CpuStockOps()
    x = torch.randn(40, 192, generator=torch.Generator().manual_seed(3))
    layer, _ = _fp8_layer(det, 4)
    together = det.moe(x, layer)
    assert all(torch.equal(together[i], det.moe(x[i : i + 1], layer)[0]) for i in range(40))
    stock_layer, _ = _fp8_layer(stock, 4)
    stock_rows = stock.moe(x, stock_layer)
    assert any(not torch.equal(stock_rows[i], stock.moe(x[i : i + 1], stock_layer)[0])
               for i in range(40))  # fmt: skip
    reference = get_ops("cpu", "float64")
    want = reference.moe(x, _fp8_layer(reference, 4)[0])
    torch.testing.assert_close(together.double(), want, rtol=1e-5, atol=1e-5)


def test_fp8_moe_presets() -> None:
    spec = PRESETS["tiny-qwen3-moe-fp8"].spec
    assert spec.is_fp8_linear("model.layers.0.mlp.experts.3.down_proj")
    assert not spec.is_fp8_linear("model.layers.0.mlp.gate")
    big = PRESETS["qwen3-30b-a3b-fp8"].spec
    assert big.fp8 == Fp8Spec("block") and big.moe == PRESETS["qwen3-30b-a3b"].spec.moe


@pytest.mark.parametrize(("suffix", "scheme"), [("-static", "tensor"), ("-channel", "channel")])
def test_row_scaled_fp8_moe_presets_keep_the_contract(suffix: str, scheme: str) -> None:
    engine = _engine(f"random:tiny-qwen3-moe-fp8{suffix}", kv_dtype="fp8_e4m3")
    sparse = [layer.mlp.layer for layer in engine.decoder.layers if hasattr(layer.mlp, "layer")]
    assert sparse and all(moe.fp8 and moe.fp8_scheme == scheme for moe in sparse)
    for seed in range(2):
        _check_case(engine, seed, max_len=48, max_mates=3)


# ---- per-tensor (ModelOpt, static activations) and per-channel (compressed-tensors,
# dynamic per-token activations) FP8 experts -------------------------------------------------

ROW_FORMATS = ("modelopt", "compressed-tensors")


@pytest.fixture(scope="module", params=ROW_FORMATS)
def row_folder(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, str]:
    path = tmp_path_factory.mktemp(f"fp8-moe-{request.param}")
    model = write_fp8_folder(path, request.param, family="qwen3_moe")
    return path, model, request.param


def test_row_scaled_fp8_moe_folder_matches_float64_reference(row_folder) -> None:
    """The experts load in their checkpoint's scheme (one scale per weight row; per tensor
    with the layer's largest input scale, tests/support/tiny_fp8.py) and the logits are the
    float64 emulation's."""
    path, model, fmt = row_folder
    loaded = resolve_model(str(path))
    decoder = Decoder.load(loaded, get_ops("cpu", "deterministic"), torch.float32, "cpu")
    moe = decoder.layers[0].mlp.layer
    assert (
        moe.fp8 and moe.fp8_scheme == {"modelopt": "tensor", "compressed-tensors": "channel"}[fmt]
    )
    assert tuple(moe.gate_up_scale.shape) == (8, 320) and tuple(moe.down_scale.shape) == (8, 192)
    assert (moe.gate_up_input_scale is not None) == (fmt == "modelopt")
    got = decoder.logits_for_sequence(TOKENS).double()
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        plain = model.to(torch.float64)(torch.tensor([TOKENS])).logits[0]
        want = float64_reference(model, path, fmt)(torch.tensor([TOKENS])).logits[0]
    assert (got - want).abs().max().item() <= 1e-5
    assert (got - plain).abs().max().item() > 1e-3  # the control, as above


def test_row_scaled_fp8_moe_folder_any_schedule_matches_cold_prefill(row_folder) -> None:
    """The property suite over the FP8 KV cache (batch-mates, radix hits, chunks, decode)."""
    engine = _engine(str(row_folder[0]), kv_dtype="fp8_e4m3")
    for seed in range(3):
        _check_case(engine, seed, max_len=64, max_mates=3)


def test_negative_control_fast_mode_breaks_row_scaled_fp8_moe(row_folder) -> None:
    engine = _engine(str(row_folder[0]), mode="reference")
    assert _batch_invariance_failures(engine, stop_at_first=True) > 0


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_row_scaled_expert_gemm_row_equals_the_dense_fp8_linear_row(scheme: str) -> None:
    """A per-channel or per-tensor expert's gate | up and down rows are the dense FP8
    linear's bits at the same weights, scales and (per tensor) static input scale, and a
    token's MoE row ignores its batch-mates."""
    ops = CpuDeterministicOps()
    g = torch.Generator().manual_seed(9)
    h, inter, experts = 192, 160, 4
    shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    q = {(e, p): quantize_weight(torch.randn(*shape, generator=g) / shape[1] ** 0.5, scheme,
                                 input_amax=2.0 + e)
         for e in range(experts) for p, shape in shapes.items()}  # fmt: skip

    def stacked(names: tuple[str, ...]):
        keys = [(e, p) for e in range(experts) for p in names]
        scales = [q[k][1][:1].reshape(()) if scheme == "tensor" else q[k][1] for k in keys]
        ins = [q[k][2] for k in keys] if scheme == "tensor" else None
        return prepare_fp8_experts(ops.prepare_fp8_linear, [q[k][0] for k in keys], scales,
                                   experts, scheme, ins)  # fmt: skip

    gate_up, down = stacked(("gate", "up")), stacked(("down",))
    router = ops.prepare_linear_weight(torch.randn(experts, h, generator=g) / h**0.5)
    layer = MoeLayer(router, gate_up.weight, down.weight, 2, True, gate_up.scale, down.scale,
                     None, scheme, gate_up.input_scale, down.input_scale)  # fmt: skip
    x = torch.randn(9, h, generator=torch.Generator().manual_seed(10))
    for e in range(experts):
        dense = ops.prepare_fp8_linear(
            scheme, torch.cat([q[e, "gate"][0], q[e, "up"][0]]),
            torch.cat([q[e, "gate"][1], q[e, "up"][1]]), gate_up.input_scale,
        )  # fmt: skip
        want = ops.fp8_linear(x, dense)
        got = ops.fp8_expert_linear(x, layer.gate_up[e], scheme, layer.gate_up_input_scale)
        assert torch.equal(got, want)
    together = ops.moe(x, layer)
    assert all(torch.equal(together[i], ops.moe(x[i : i + 1], layer)[0]) for i in range(9))
    reference = get_ops("cpu", "float64")
    ref_layer = dataclasses.replace(layer, router=router.double(),
                                    gate_up=torch.stack([torch.cat([q[e, "gate"][0], q[e, "up"][0]])
                                                         for e in range(experts)]),
                                    down=torch.stack([q[e, "down"][0] for e in range(experts)]))  # fmt: skip
    want = reference.moe(x, ref_layer)
    torch.testing.assert_close(together.double(), want, rtol=1e-5, atol=1e-5)


def test_fp8_moe_with_one_unquantized_expert_is_refused(folder, tmp_path: Path) -> None:
    """An expert stored in bf16 beside FP8 experts cannot share their grouped GEMM."""
    path = shutil.copytree(folder[0], tmp_path / "mixed")
    e = "model/layers/0/mlp/experts/3/up_proj/"
    edit_tensors(path, **{e + "weight": torch.zeros(160, 192, dtype=torch.bfloat16),
                          e + "weight_scale_inv": None})  # fmt: skip
    with pytest.raises(ModelLoadError, match="experts.3.up_proj is not FP8"):
        Decoder.load(resolve_model(str(path)), get_ops("cpu", "float64"), torch.float32, "cpu")


def test_fp8_moe_weight_update_in_place_gives_the_new_models_bits() -> None:
    """`Decoder.update_weights` replaces FP8 experts (weights and block scales) in place: the
    updated decoder computes the bits of one loaded from the new weights."""
    name, ops = "random:tiny-qwen3-moe-fp8", get_ops("cpu", "deterministic")
    old, new = resolve_model(name, random_seed=1), resolve_model(name, random_seed=2)
    decoder = Decoder.load(old, ops, torch.float32, "cpu")
    gate_up = decoder.layers[0].mlp.layer.gate_up
    before = decoder.logits_for_sequence(TOKENS)
    decoder.update_weights(new.iter_weights(torch.float32, "cpu"), "seed 2")
    assert decoder.layers[0].mlp.layer.gate_up is gate_up  # the same storage
    want = Decoder.load(new, ops, torch.float32, "cpu").logits_for_sequence(TOKENS)
    got = decoder.logits_for_sequence(TOKENS)
    assert torch.equal(got, want) and not torch.equal(before, want)
