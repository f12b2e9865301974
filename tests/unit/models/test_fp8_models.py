"""FP8 checkpoints end to end on the CPU: tiny folders in each format (tests/support/tiny_fp8.py) load
and give the logits of an independent float64 reference of the same quantized math; bad
checkpoints are refused in one line naming the tensor or field, by the library and by the
`lockstep` command (non-zero exit, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from lockstep.errors import ModelLoadError  # noqa: E402
from lockstep.models.decoder import Decoder  # noqa: E402
from lockstep.models.resolver import resolve_model  # noqa: E402
from lockstep.ops import get_ops  # noqa: E402
from lockstep.ops.fp8 import Fp8Weight  # noqa: E402
from tests.support.tiny_fp8 import (  # noqa: E402
    FORMATS,
    edit_tensors,
    float64_reference,
    set_quantization_config,
    write_fp8_folder,
)

TOKENS = [5, 17, 200, 33, 91, 7, 150, 64, 2, 250, 11, 99]
SKIP = ("model.layers.1.mlp.down_proj",)  # one format also has an unquantized projection


def _lockstep_logits(folder: Path) -> torch.Tensor:
    loaded = resolve_model(str(folder))
    decoder = Decoder.load(loaded, get_ops("cpu", "deterministic"), torch.float32, "cpu")
    return decoder.logits_for_sequence(TOKENS).double(), decoder


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_folder_matches_float64_reference(tmp_path: Path, fmt: str) -> None:
    skip = SKIP if fmt == "compressed-tensors" else ()
    model = write_fp8_folder(tmp_path, fmt, skip)
    got, decoder = _lockstep_logits(tmp_path)
    assert isinstance(decoder.layers[0].mixer.qkv, Fp8Weight)
    assert isinstance(decoder.layers[1].mlp.down, Fp8Weight) == (not skip)
    with torch.no_grad():
        plain = model.to(torch.float64)(torch.tensor([TOKENS])).logits[0]
        reference = float64_reference(model, tmp_path, fmt, skip)
        want = reference(torch.tensor([TOKENS])).logits[0]
    assert (got - want).abs().max().item() <= 1e-5
    # The control: the unquantized model is far from the quantized one at this tolerance.
    assert (got - plain).abs().max().item() > 1e-3


@pytest.fixture(scope="module")
def block_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fp8-block")
    write_fp8_folder(folder, "fp8-block")
    return folder


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _load(folder: Path) -> None:
    loaded = resolve_model(str(folder))
    Decoder.load(loaded, get_ops("cpu", "float64"), torch.float32, "cpu")


Q = "model/layers/0/self_attn/q_proj/"


@pytest.mark.parametrize(
    ("tensors", "config", "needles"),
    [
        ({Q + "weight_scale_inv": None}, {}, ["q_proj.weight_scale_inv is missing"]),
        ({Q + "weight_scale_inv": torch.ones(3, 2)}, {}, ["q_proj.weight_scale", "[3, 2]"]),
        ({Q + "weight_scale_inv": torch.ones(2, 2, dtype=torch.int32)}, {},
         ["q_proj.weight_scale", "int32"]),
        ({"model/embed_tokens/weight": torch.zeros(300, 192, dtype=torch.float8_e4m3fn)}, {},
         ["embed_tokens.weight", "float8_e4m3fn"]),
        ({}, {"quant_method": "awq"}, ["quant_method='awq'", "supported"]),
        ({}, {"weight_block_size": [64, 64]}, ["weight_block_size", "[128, 128]"]),
        ({}, {"weight_block_size": None}, ["activation_scheme='dynamic'", "per token"]),
    ],
)  # fmt: skip
def test_bad_fp8_checkpoint_is_one_clear_error(
    block_folder: Path, tmp_path: Path, tensors: dict, config: dict, needles: list[str]
) -> None:
    folder = _copy(block_folder, tmp_path / "bad")
    if tensors:
        edit_tensors(folder, **tensors)
    if config:
        set_quantization_config(folder, **config)
    with pytest.raises(ModelLoadError) as info:
        _load(folder)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_fp8_weight_stored_in_bf16_is_refused(block_folder: Path, tmp_path: Path) -> None:
    """A projection whose scale is present but whose weight is not e4m3: its scale is then an
    unexpected tensor for an unquantized projection, named in one line."""
    folder = _copy(block_folder, tmp_path / "bad")
    edit_tensors(folder, **{Q + "weight": torch.zeros(256, 192, dtype=torch.bfloat16)})
    with pytest.raises(ModelLoadError, match="q_proj.weight_scale"):
        _load(folder)


@pytest.mark.parametrize("case", ["missing-scale", "per-tensor-dynamic"])
def test_cli_refuses_a_bad_fp8_checkpoint_in_one_line(
    block_folder: Path, tmp_path: Path, case: str
) -> None:
    folder = _copy(block_folder, tmp_path / "bad")
    if case == "missing-scale":
        edit_tensors(folder, **{Q + "weight_scale_inv": None})
        needle = "q_proj.weight_scale_inv is missing"
    else:
        set_quantization_config(folder, weight_block_size=None)
        needle = "activation_scheme"
    out = subprocess.run(
        [sys.executable, "-m", "lockstep", "generate", "hi", "--model", str(folder)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr
