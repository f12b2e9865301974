"""The stock GPU backend's linear takes the float32 biases the loader prepares (Qwen2's q/k/v
biases) with bfloat16 activations, as the stock layer does: bias added in the activations'
dtype. The op is plain torch, so the CPU runs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lockstep.ops.gpu_stock import GpuStockOps


def test_bf16_activations_with_a_float32_bias() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=gen).bfloat16()
    w = torch.randn(5, 8, generator=gen).bfloat16()
    bias = torch.randn(5, generator=gen)  # float32, as prepared
    out = GpuStockOps().linear(x, w, bias)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x, w, bias.bfloat16()))
    # Control: the mixed dtypes handed to torch as they are fail.
    with pytest.raises(RuntimeError):
        F.linear(x, w, bias)
