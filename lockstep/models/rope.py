"""Rotary position embeddings: each model's cos / sin tables, computed once in float64 from
its spec (plain RoPE with a base and a linear factor, Llama 3 frequency scaling, YaRN,
LongRoPE, Gemma 3's own base for its sliding layers), so every step and every device type
indexes the same table instead of recomputing angles.

LongRoPE (Phi-3, `LongRopeScaling`) is a function of the position alone here: a position
below `original_max_position` rotates by the short factors, one at or beyond it by the long
factors. transformers instead picks one set for a whole forward by the sequence's length
(long past the original context), so the two agree wherever a sequence stays within the
original context; past it, transformers' earlier positions would change rotation with the
sequence's length, which the contract (docs/design.md) forbids.
"""

from __future__ import annotations

import math

import torch

from lockstep.models.spec import ModelSpec, YarnScaling


def rope_tables(
    spec: ModelSpec, max_position: int, sliding: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_position, head_dim/2] float32, computed once in float64 (so every step and
    every device type indexes the same table instead of recomputing angles). `sliding`: the
    tables of the sliding-window layers where they have their own base (Gemma 3's: unscaled).
    LongRoPE: positions below its original context rotate by the short factors' frequencies,
    the others by the long factors' (a function of the position alone, module docstring)."""
    half = spec.rotary_dim // 2
    exponent = torch.arange(half, dtype=torch.float64) * 2.0 / spec.rotary_dim
    if sliding:
        assert spec.sliding is not None and spec.sliding.rope_theta is not None
        inv_freq = 1.0 / (spec.sliding.rope_theta**exponent)
    else:
        inv_freq = 1.0 / (spec.rope_theta**exponent) / spec.rope_linear_factor
    yarn = None if sliding else spec.yarn
    if yarn is not None:
        inv_freq = _yarn_inv_freq(yarn, spec.rope_theta, spec.rotary_dim)
    s = None if sliding else spec.rope_scaling
    if s is not None:
        # Llama 3 frequency scaling: long wavelengths are divided by `factor`, short ones kept,
        # the band between is interpolated smoothly.
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)
    positions = torch.arange(max_position, dtype=torch.float64)[:, None]
    angles = positions * inv_freq[None, :]
    factor = 1.0 if yarn is None else yarn.attention_factor  # YaRN scales cos and sin
    longrope = None if sliding else spec.longrope
    if longrope is not None:
        short, long = (
            1.0 / (torch.tensor(f, dtype=torch.float64) * spec.rope_theta**exponent)
            for f in (longrope.short_factor, longrope.long_factor)
        )
        beyond = positions >= longrope.original_max_position
        angles = torch.where(beyond, positions * long[None, :], positions * short[None, :])
        factor = longrope.attention_factor
    return (angles.cos() * factor).to(torch.float32), (angles.sin() * factor).to(torch.float32)


def _yarn_inv_freq(yarn: YarnScaling, theta: float, dim: int) -> torch.Tensor:
    """YaRN's frequencies (float64), as transformers' _compute_yarn_parameters: each blends
    the interpolated (divided by the factor) and the extrapolated frequency by a linear ramp
    between the dims where `beta_fast` and `beta_slow` rotations fit the original context."""

    def correction_dim(rotations: float) -> float:
        ratio = yarn.original_max_position / (rotations * 2 * math.pi)
        return dim * math.log(ratio) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation = 1 - ramp
    return extrapolated / yarn.factor * (1 - extrapolation) + extrapolated * extrapolation
