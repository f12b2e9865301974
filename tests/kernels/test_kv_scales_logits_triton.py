"""The GPU backend's kernels over a checkpoint-scaled FP8 KV cache, end to end: the tiny
folders of tests/support/tiny_fp8_kv.py through `GpuDeterministicOps` (Triton; under the
interpreter on CPU machines) against the float64 emulation of the scaled cache.

In bfloat16 activations, as on the GPU, the logits are judged against the bf16 floor of the
same model (tests/support/kv_scale_accuracy.py, which tests/gpu/test_gpu_fp8_formats.py runs
on the GPU with more prompts). In float32 activations, under the interpreter (whose dots are
exact, where Hopper's FP8 and TF32 dots are not), the same kernels give the emulation's logits
within 1e-6 RMS. Negative controls: the cache at scale 1.0 (keys and values beyond 448
saturate) fails both checks, and attention that reads the cache without the scales its write
used fails the float32 one."""

from __future__ import annotations

import dataclasses

import pytest
import test_ops_triton  # noqa: F401  (installs the row-local interpreter dot on CPU machines)
import torch

pytest.importorskip("transformers")

from lockstep.models.decoder import Decoder  # noqa: E402
from lockstep.models.resolver import resolve_model  # noqa: E402
from lockstep.ops.base import LayerKV  # noqa: E402
from lockstep.ops.gpu_deterministic import GpuDeterministicOps  # noqa: E402
from tests.support.kv_scale_accuracy import (  # noqa: E402
    TOKENS,
    float64_logits,
    kv_scale_errors,
    rms_error,
)
from tests.support.tiny_fp8_kv import write_kv_scaled_folder  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
E4M3 = torch.float8_e4m3fn
# Padding rows divide 0 by 0 in discarded branches; numpy (the interpreter) warns about them.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


class ReadsWithoutScales(GpuDeterministicOps):
    """The control's fault: attention over the cache as if its scales were 1.0, while the
    attention-input kernel still writes k / k_scale and v / v_scale."""

    def attention(self, q, kv: LayerKV, meta, scale: float, window=None) -> torch.Tensor:
        return super().attention(q, LayerKV(kv.k, kv.v), meta, scale, window)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """ModelOpt's names (the format whose GPU run first met this check) and its decoder."""
    path = tmp_path_factory.mktemp("kv-scales-modelopt")
    model, scales = write_kv_scaled_folder(path, "modelopt")
    return path, model, scales, resolve_model(str(path))


def _loader(loaded, dtype: torch.dtype, ops: GpuDeterministicOps | None = None):
    def load(spec, kv_dtype: torch.dtype) -> Decoder:
        decoder = Decoder.load(dataclasses.replace(loaded, spec=spec), ops or GpuDeterministicOps(),
                               dtype, DEV, kv_dtype=kv_dtype)  # fmt: skip
        # A CPU decoder keeps float32 activations (`decoder.activation_dtype`); the GPU's are
        # the model dtype, and the Triton kernels take either.
        decoder.act_dtype = dtype
        return decoder

    return load


def test_bf16_logits_over_the_scaled_cache_sit_at_the_bf16_floor(folder) -> None:
    path, model, scales, loaded = folder
    errors = kv_scale_errors(_loader(loaded, torch.bfloat16), loaded, model, path, "modelopt",
                             scales, [TOKENS])  # fmt: skip
    errors.check()  # with its control: the cache at scale 1.0 is beyond the floor


@pytest.mark.skipif(GPU, reason="inexact tensor-core dots; the bf16 check runs on the GPU")
def test_float32_logits_over_the_scaled_cache_equal_the_emulation(folder) -> None:
    path, model, scales, loaded = folder
    _, emulated = float64_logits(model, path, "modelopt", scales, [TOKENS])
    load = _loader(loaded, torch.float32)
    assert rms_error(load(loaded.spec, E4M3), [TOKENS], emulated) <= 1e-6
    unscaled = dataclasses.replace(loaded.spec, kv_cache_scales=None)
    assert rms_error(load(unscaled, E4M3), [TOKENS], emulated) > 1e-2
    # Writing with the scales and reading without them.
    wrong = _loader(loaded, torch.float32, ReadsWithoutScales())(loaded.spec, E4M3)
    assert rms_error(wrong, [TOKENS], emulated) > 1e-2
