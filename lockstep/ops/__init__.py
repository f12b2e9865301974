"""The numeric layer. `get_ops(device, mode)` is the one dispatch point (see `base.Ops`)."""

from __future__ import annotations

from lockstep.ops.base import AttentionMeta, Ops, build_attention_meta

__all__ = ["AttentionMeta", "Ops", "build_attention_meta", "get_ops"]


def get_ops(device: str, mode: str) -> Ops:
    """Return the backend for `device` ("cpu" | "cuda") and `mode` ("deterministic" | "fast"),
    or "reference" (float64, tests only)."""
    if mode == "reference":
        from lockstep.ops.reference import ReferenceOps

        return ReferenceOps()
    if device == "cpu":
        if mode == "deterministic":
            from lockstep.ops.cpu_deterministic import CpuDeterministicOps

            return CpuDeterministicOps()
        from lockstep.ops.cpu_fast import CpuFastOps

        return CpuFastOps()
    if device == "cuda":
        if mode == "deterministic":
            from lockstep.ops.gpu_deterministic import GpuDeterministicOps

            return GpuDeterministicOps()
        from lockstep.ops.gpu_fast import GpuFastOps

        return GpuFastOps()
    raise ValueError(f"device={device!r} is invalid: expected cpu or cuda")
