"""The numeric layer. `get_ops(device, mode)` is the one dispatch point (see `base.Ops`)."""

from __future__ import annotations

from lockstep.ops.base import AttentionMeta, Ops, build_attention_meta

__all__ = ["AttentionMeta", "Ops", "build_attention_meta", "get_ops"]


def get_ops(device: str, mode: str, mla_fused_input: bool = False) -> Ops:
    """Return the backend for `device` ("cpu" | "cuda") and `mode`: "deterministic" (the
    engine's invariant kernels), "reference" (stock torch, the negative control), or "float64"
    (the float64 oracle, tests only). Modes arrive here already canonical (`fast`, the old
    name of "reference", is resolved by `lockstep.config.canonical_mode`). `mla_fused_input`:
    the CUDA deterministic backend's MLA input kernels (`EngineConfig.mla_fused_input`)."""
    if mode == "float64":
        from lockstep.ops.float64 import Float64Ops

        return Float64Ops()
    if mode not in ("deterministic", "reference"):
        raise ValueError(f"mode={mode!r} is invalid: expected deterministic, reference or float64")
    if device == "cpu":
        if mode == "deterministic":
            from lockstep.ops.cpu_deterministic import CpuDeterministicOps

            return CpuDeterministicOps()
        from lockstep.ops.cpu_stock import CpuStockOps

        return CpuStockOps()
    if device == "cuda":
        if mode == "deterministic":
            from lockstep.ops.gpu_deterministic import GpuDeterministicOps

            return GpuDeterministicOps(fused_latent_input=mla_fused_input)
        from lockstep.ops.gpu_stock import GpuStockOps

        return GpuStockOps()
    raise ValueError(f"device={device!r} is invalid: expected cpu or cuda")
