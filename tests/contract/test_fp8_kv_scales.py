"""Checkpoint KV cache scales with the FP8 cache (lockstep/ops/fp8.py, "FP8 KV cache"): tiny
folders in each format (tests/support/tiny_fp8_kv.py), whose keys and values reach beyond
448, load their per-layer k/v scales and give the logits of a float64 emulation of the
quantized model over the scaled FP8 cache; the property suite holds with those scales; a
dynamic or malformed KV scale is refused in one line. Negative controls: the same folder
read at scale 1.0 saturates at 448 and misses the emulation, and reference mode breaks the suite."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_position_invariance import (  # noqa: E402
    _batch_invariance_failures,
    _check_case,
    _engine,
    _prefix_hit_at_every_offset,
)

from lockstep.errors import ModelLoadError  # noqa: E402
from lockstep.models.decoder import Decoder  # noqa: E402
from lockstep.models.resolver import resolve_model  # noqa: E402
from lockstep.ops import get_ops  # noqa: E402
from lockstep.ops.base import LayerKV, build_attention_meta  # noqa: E402
from lockstep.ops.fp8 import E4M3  # noqa: E402
from tests.support.tiny_fp8 import (  # noqa: E402
    edit_tensors,
    set_quantization_config,
    write_fp8_folder,
)
from tests.support.tiny_fp8_kv import (  # noqa: E402
    KV_FORMATS,
    kv_reference,
    write_kv_scaled_folder,
)

TOKENS = [5, 17, 200, 33, 91, 7, 150, 64, 2, 250, 11, 99]


def _decoder(path: Path, scaled: bool = True) -> Decoder:
    """The folder's decoder with an FP8 KV cache; `scaled` False: its KV scales dropped (the
    cache at scale 1.0, the control)."""
    loaded = resolve_model(str(path))
    if not scaled:
        loaded = dataclasses.replace(
            loaded, spec=dataclasses.replace(loaded.spec, kv_cache_scales=None)
        )
    ops = get_ops("cpu", "deterministic")
    return Decoder.load(loaded, ops, torch.float32, "cpu", kv_dtype=E4M3)


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_kv_scaled_folder_matches_the_float64_emulation(tmp_path: Path, kv_format: str) -> None:
    model, scales = write_kv_scaled_folder(tmp_path, kv_format)
    assert max(max(kv) for kv in scales.values()) * 448 > 448  # values beyond 448 * 1.0
    decoder = _decoder(tmp_path)
    written = decoder.spec.kv_cache_scales
    assert written is not None
    assert list(zip(written.k, written.v, strict=True)) == [scales[i] for i in sorted(scales)]
    got = decoder.logits_for_sequence(TOKENS).double()
    with torch.no_grad():
        want = kv_reference(model, tmp_path, kv_format, scales)(torch.tensor([TOKENS]))
    want = want.logits[0]
    assert (got - want).abs().max().item() <= 1e-5
    # The control: at scale 1.0 the cache clips the keys and values at 448.
    unscaled = _decoder(tmp_path, scaled=False).logits_for_sequence(TOKENS).double()
    assert (unscaled - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("backend", ["deterministic", "reference", "float64"])
def test_a_value_beyond_448_survives_the_scaled_cache(backend: str) -> None:
    """Each CPU backend writes k / scale and reads the stored value times scale: 960 at
    scale 4 comes back as 960 (240, an e4m3 value, times 4), at scale 1.0 as 448."""
    ops = get_ops("cpu", backend)
    k, v, q = (torch.full((1, 1, 32), 0.5) for _ in range(3))  # head_dim 32: the C++ kernel's
    k[0, 0, 0], v[0, 0, 0] = 960.0, -960.0
    meta = build_attention_meta([1], [0], [[0]])
    for scale, want in ((4.0, 960.0), (1.0, 448.0)):
        cache = LayerKV(torch.zeros(1, 1, 32, dtype=E4M3), torch.zeros(1, 1, 32, dtype=E4M3),
                        scale, scale)  # fmt: skip
        ops.write_kv(cache.k, cache.v, k, v, torch.tensor([0]), scale, scale)
        assert cache.k.float()[0, 0, 0].item() * scale == want
        out = ops.attention(q, cache, meta, 1.0)  # one key: the output is its value
        assert out[0, 0, 0].item() == -want


@pytest.fixture(scope="module")
def scaled_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fp8-kv-scales")
    write_kv_scaled_folder(path, "compressed-tensors")
    return path


def test_kv_scaled_folder_any_schedule_matches_cold_prefill(scaled_folder: Path) -> None:
    """The property suite over the scaled FP8 cache: batch-mates, radix hits, chunked
    prefill and decode steps give the bits of one cold prefill (logits and K/V entries)."""
    engine = _engine(str(scaled_folder), kv_dtype="fp8_e4m3")
    assert engine.decoder.layers[0].mixer.kv_scales != (1.0, 1.0)
    for seed in range(4):
        _check_case(engine, seed, max_len=64, max_mates=3)
    _prefix_hit_at_every_offset(engine, 34)  # past the CPU kernel's 32-key block


def test_negative_control_fast_mode_breaks_the_scaled_cache_suite(scaled_folder: Path) -> None:
    engine = _engine(str(scaled_folder), mode="reference", kv_dtype="fp8_e4m3")
    assert _batch_invariance_failures(engine, stop_at_first=True) > 0


KV = "model/layers/1/self_attn/"


@pytest.mark.parametrize(
    ("tensors", "config", "needles"),
    [
        ({}, {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                  "dynamic": True}},
         ["kv_cache_scheme.dynamic=True", "batch-mates"]),
        ({}, {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head",
                                  "dynamic": False}},
         ["kv_cache_scheme.strategy='attn_head'", "one static scale per layer"]),
        ({}, {"kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor"}},
         ["kv_cache_scheme", "8-bit float"]),
        ({KV + "v_scale": None}, {}, ["layer 1's KV cache v_scale is missing"]),
        ({KV + "k_scale": torch.ones(2)}, {}, ["k_scale", "[2]", "one float scale per layer"]),
        ({KV + "k_scale": torch.tensor([-1.0])}, {}, ["k_scale = -1.0", "finite and > 0"]),
        ({KV + "kv_scale": torch.tensor(1.0)}, {}, ["both a kv_scale and a k_scale"]),
        ({KV + "k_proj/k_scale": torch.tensor(1.0)}, {},
         ["self_attn.k_proj.k_scale", "self_attn.k_scale", "both the same layer's"]),
        ({}, {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                  "dynamic": False, "symmetric": False}},
         ["kv_cache_scheme.symmetric=False", "no zero points"]),
    ],
)  # fmt: skip
def test_bad_kv_scales_are_one_clear_error(
    scaled_folder: Path, tmp_path: Path, tensors: dict, config: dict, needles: list[str]
) -> None:
    folder = shutil.copytree(scaled_folder, tmp_path / "bad")
    if tensors:
        edit_tensors(folder, **tensors)
    if config:
        set_quantization_config(folder, **config)
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(folder))
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_declared_kv_scales_without_tensors_are_refused(scaled_folder: Path, tmp_path: Path):
    folder = shutil.copytree(scaled_folder, tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    edit_tensors(folder, **{f"model/layers/{i}/self_attn/{r}_scale": None
                            for i in range(layers) for r in "kv"})  # fmt: skip
    with pytest.raises(ModelLoadError, match="declares an FP8 KV cache but no tensor") as info:
        resolve_model(str(folder))
    assert "\n" not in str(info.value)


def test_modelopt_kv_algorithm_other_than_fp8_is_refused(tmp_path: Path) -> None:
    write_kv_scaled_folder(tmp_path, "modelopt")
    set_quantization_config(tmp_path, kv_cache_quant_algo="NVFP4")
    with pytest.raises(ModelLoadError, match="kv_cache_quant_algo='NVFP4'") as info:
        resolve_model(str(tmp_path))
    assert "\n" not in str(info.value)


def test_kv_scales_on_latent_attention_are_refused(tmp_path: Path) -> None:
    """A DeepSeek (MLA) folder with KV scales: its FP8 latent cache has scale 1.0, so the
    scales are refused in one line rather than ignored."""
    write_fp8_folder(tmp_path, "fp8-block", family="deepseek_v3")
    edit_tensors(tmp_path, **{f"model/layers/{i}/self_attn/{r}_scale": torch.tensor(2.0)
                              for i in range(2) for r in "kv"})  # fmt: skip
    with pytest.raises(ModelLoadError, match="multi-head latent attention") as info:
        resolve_model(str(tmp_path))
    assert "\n" not in str(info.value)


def test_kv_scale_names_of_every_format() -> None:
    from lockstep.models.fp8_formats import kv_scale_name

    at = "model.layers.3.self_attn."
    want = {"k_proj.k_scale": "k", "v_proj.v_scale": "v", "k_scale": "k", "v_scale": "v",
            "k_proj.output_scale": "k", "v_proj.output_scale": "v", "kv_scale": "kv"}  # fmt: skip
    assert {leaf: kv_scale_name(at + leaf) for leaf in want} == {
        leaf: (3, role) for leaf, role in want.items()
    }
    for other in (at + "q_proj.input_scale", at + "k_proj.weight_scale", "lm_head.k_scale",
                  "model.layers.x.self_attn.k_scale", at + "o_proj.output_scale"):  # fmt: skip
        assert kv_scale_name(other) is None, other


def test_cli_refuses_a_dynamic_kv_cache_scheme_in_one_line(scaled_folder: Path, tmp_path: Path):
    folder = shutil.copytree(scaled_folder, tmp_path / "dynamic")
    set_quantization_config(folder, kv_cache_scheme={"num_bits": 8, "type": "float",
                                                     "strategy": "tensor", "dynamic": True})  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "lockstep", "generate", "hi", "--model", str(folder),
         "--kv-dtype", "fp8_e4m3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "kv_cache_scheme.dynamic=True" in lines[0], out.stderr
