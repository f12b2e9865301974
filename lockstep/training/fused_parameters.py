"""Canonical parameters that are rows of one fused weight, so that a training step reads the
decoder's fused linears (q|k|v, gate|up) without concatenating them.

The decoder multiplies by one fused weight per such linear (`weight_layout`'s "linear" entries
of several sources: rows of q_proj, k_proj, v_proj one after another). The training module
allocates that fused tensor once, at load, and registers each canonical parameter as a view of
its rows:

    buffer [q + k + v, hidden]     one allocation, what the decoder's linear reads
      rows 0 .. q                  model.layers.i.self_attn.q_proj.weight  (an nn.Parameter)
      rows q .. q + k              model.layers.i.self_attn.k_proj.weight
      rows q + k .. q + k + v      model.layers.i.self_attn.v_proj.weight

`state_dict()`, `named_parameters()` and the optimizer see the canonical tensors, as before;
an optimizer's in-place update of a parameter, or `load_state_dict`'s copy into it, is an
update of the buffer's rows. Each forward hands the buffer to the decoder through `SharedRows`,
an autograd Function whose forward returns the buffer itself (no copy) and whose backward
splits the fused weight's gradient into the parameters' gradients (row views of it, no copy).

The sharing holds while every parameter is still its rows of the buffer: `FusedRows.intact`
checks it each step, and where it fails (`param.data` reassigned, `load_state_dict(...,
assign=True)`, the module moved) the step concatenates the parameters instead, as the
decoder's own preparation does: slower, same bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep.models.blocks.base import LayoutEntry


@dataclass(frozen=True)
class FusedRows:
    """One fused linear's `buffer` [rows, columns] and its canonical parameters' `names`, in
    row order, parameter i holding rows `bounds[i]` of it."""

    target: str
    names: tuple[str, ...]
    bounds: tuple[tuple[int, int], ...]
    buffer: torch.Tensor

    def intact(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Whether each parameter in `params` (by canonical name) is still its rows of the
        buffer: same address, shape, strides, dtype and device."""
        buffer = self.buffer
        row_bytes = buffer.stride(0) * buffer.element_size()
        for name, (lo, hi) in zip(self.names, self.bounds, strict=True):
            p = params[name]
            if (
                p.device != buffer.device
                or p.dtype != buffer.dtype
                or p.shape != (hi - lo, buffer.shape[1])
                or p.stride() != buffer.stride()
                or p.data_ptr() != buffer.data_ptr() + lo * row_bytes
            ):
                return False
        return True

    def weight(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The buffer as a differentiable function of the parameters (their rows stacked),
        without a copy; valid while `intact(params)`."""
        return SharedRows.apply(self, *(params[n] for n in self.names))


class SharedRows(torch.autograd.Function):
    """forward(rows, *parameters): `rows.buffer`, which the parameters are row views of (a
    detached alias: the forward copies nothing); backward: the gradient's rows, one view per
    parameter."""

    @staticmethod
    def forward(ctx: Any, rows: FusedRows, *parts: torch.Tensor) -> torch.Tensor:
        ctx.counts = [hi - lo for lo, hi in rows.bounds]
        return rows.buffer.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *grad.split(ctx.counts))


def fusable(entry: LayoutEntry, params: Mapping[str, torch.Tensor]) -> bool:
    """Whether an entry's prepared weight is its sources' rows stacked as they are: a
    "linear" entry of two or more distinct 2-D parameters of one dtype, device and width
    (a tensor-parallel rank keeps every row: the training module runs at TP 1)."""
    sources = entry.sources
    if entry.kind != "linear" or len(sources) < 2 or len(set(sources)) != len(sources):
        return False
    tensors = [params.get(n) for n in sources]
    if any(not isinstance(t, nn.Parameter) or t.dim() != 2 for t in tensors):
        return False
    first = tensors[0]
    assert first is not None
    return all(
        t is not None
        and (t.dtype, t.device, t.shape[1]) == (first.dtype, first.device, first.shape[1])
        for t in tensors
    )


def share_rows(module: nn.Module, entry: LayoutEntry) -> FusedRows:
    """Move the parameters `entry.sources` of `module` (canonical names) into one fused
    buffer, each re-registered as a `nn.Parameter` viewing its rows (same names, values and
    `requires_grad`); the `FusedRows` that hands the buffer to the decoder."""
    tensors = [module.get_parameter(n) for n in entry.sources]
    with torch.no_grad():
        buffer = torch.cat([t.detach() for t in tensors], dim=0)
    bounds, lo = [], 0
    for name, tensor in zip(entry.sources, tensors, strict=True):
        hi = lo + tensor.shape[0]
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        owner.register_parameter(leaf, nn.Parameter(buffer[lo:hi], tensor.requires_grad))
        bounds.append((lo, hi))
        lo = hi
    return FusedRows(entry.target, tuple(entry.sources), tuple(bounds), buffer)
