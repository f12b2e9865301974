"""Scatter new keys and values into the paged caches: an exact copy, one token per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k, v, kc, vc, slots, HD, skt, svt, skc, svc, BLOCK: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # A negative slot marks a padding row (e.g. a CUDA graph's unused batch rows): no write.
    mask = (offs < HD) & (offs * 0 + slot >= 0)  # broadcast: the interpreter wants a tensor
    tl.store(kc + slot * skc + offs, tl.load(k + t * skt + offs, mask=mask), mask=mask)
    tl.store(vc + slot * svc + offs, tl.load(v + t * svt + offs, mask=mask), mask=mask)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k, v [T, Hkv, D] -> caches [S, Hkv, D] at rows `slots` [T]; rows whose slot is
    negative are padding and are not written."""
    if k.shape != v.shape or k.dim() != 3 or k_cache.shape[1:] != k.shape[1:]:
        raise ValueError(f"write_kv shapes k {tuple(k.shape)} v {tuple(v.shape)} cache "
                         f"{tuple(k_cache.shape)}")  # fmt: skip
    if v_cache.shape != k_cache.shape or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError("write_kv caches and inputs must share shape and dtype")
    if slots.shape != (k.shape[0],):
        raise ValueError(f"slots {tuple(slots.shape)} != ({k.shape[0]},)")
    # One token's [Hkv, D] must be one contiguous run in every tensor.
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"write_kv wants {name} contiguous per token")
    hd = k.shape[1] * k.shape[2]
    if k.shape[0]:
        block = min(2048, triton.next_power_of_2(hd))
        _write_kv_kernel[(k.shape[0], triton.cdiv(hd, block))](
            k, v, k_cache, v_cache, slots, hd, k.stride(0), v.stride(0), k_cache.stride(0),
            v_cache.stride(0), BLOCK=block, num_warps=4,
        )  # fmt: skip
