"""How close bfloat16 logits over a checkpoint-scaled FP8 KV cache come to the float64
emulation (tests/support/tiny_fp8_kv.py), judged against the bfloat16 floor of the same model.

Why a floor and not a fixed fraction of the unscaled error: the tiny folders' projections are
FP8 with FP8 activations (static input scales, or dynamic per token), and every bf16 rounding
upstream of an activation quantization can move a value across an e4m3 rounding boundary,
which changes it by a whole e4m3 step (1/16 of the value, against bf16's 1/256). So bf16
activations move these models' logits far more than bf16 moves an unquantized model's: about
a third of what saturating the cache at scale 1.0 moves them (figures: docs/results.md,
"FP8 KV cache scales against the float64 emulation"). No correct kernel beats that floor, so
the checks are relative to it, measured in the same call:

  floor     the decoder with a bf16 cache against the float64 model with an exact cache:
            what bf16 activations cost this model, with no FP8 cache at all;
  scaled    the FP8 cache at the checkpoint's scales against the float64 emulation at those
            scales: within SCALED_BOUND x floor when the scales are written and read
            consistently (the cache's own roundings add little beside the floor);
  unscaled  the FP8 cache at scale 1.0 against the same emulation: beyond CONTROL_BOUND x
            floor (keys and values beyond 448 saturate), the control that shows the check sees
            the scales.

Each is the root mean square over every logit of the prompts, so one chaotic position does not
decide a verdict."""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.support.tiny_fp8 import float64_reference
from tests.support.tiny_fp8_kv import WEIGHTS, kv_reference

TOKENS = [5, 17, 200, 33, 91, 7, 150, 64, 2, 250, 11, 99]
SCALED_BOUND = 1.5
CONTROL_BOUND = 2.0


def prompts(count: int, length: int = 24, vocab: int = 300) -> list[list[int]]:
    """TOKENS and `count - 1` seeded random prompts of `length` tokens."""
    rest = [[random.Random(s).randrange(vocab) for _ in range(length)] for s in range(count - 1)]
    return [TOKENS, *rest]


@dataclasses.dataclass(frozen=True)
class KvScaleErrors:
    """RMS logit errors (module docstring): floor, scaled, unscaled."""

    floor: float
    scaled: float
    unscaled: float

    def check(self) -> None:
        """Raise AssertionError unless scaled <= SCALED_BOUND x floor (the scaled cache costs
        about what bf16 costs) and unscaled > CONTROL_BOUND x floor (the control bites)."""
        assert self.scaled <= SCALED_BOUND * self.floor, self
        assert self.unscaled > CONTROL_BOUND * self.floor, self


def float64_logits(
    model: Any, folder: Path, kv_format: str, scales: dict, token_lists: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 references over every prompt, rows concatenated: the quantized model with an
    exact cache, and with the FP8 cache emulated at `scales`. `model` is left as it was (the
    references convert and edit copies)."""
    exact = float64_reference(copy.deepcopy(model), folder, WEIGHTS[kv_format])
    exact.config._attn_implementation = "eager"
    emulated = kv_reference(copy.deepcopy(model), folder, kv_format, scales)
    with torch.no_grad():
        return tuple(
            torch.cat([m(torch.tensor([t])).logits[0] for t in token_lists])
            for m in (exact, emulated)
        )  # type: ignore[return-value]


def rms_error(decoder: Any, token_lists: list[list[int]], want: torch.Tensor) -> float:
    """Root mean square of the decoder's cold-prefill logits of every prompt minus `want`."""
    got = torch.cat([decoder.logits_for_sequence(t).double().cpu() for t in token_lists])
    return float((got - want).pow(2).mean().sqrt())


def kv_scale_errors(
    load: Callable[[Any, torch.dtype], Any],
    loaded: Any,
    model: Any,
    folder: Path,
    kv_format: str,
    scales: dict,
    token_lists: list[list[int]],
) -> KvScaleErrors:
    """`load(spec, kv_dtype)` builds a bf16 decoder of the folder (`loaded`, its resolved
    model) with that spec and cache dtype; the three errors of the module docstring."""
    exact, emulated = float64_logits(model, folder, kv_format, scales, token_lists)
    unscaled_spec = dataclasses.replace(loaded.spec, kv_cache_scales=None)
    e4m3 = torch.float8_e4m3fn
    return KvScaleErrors(
        floor=rms_error(load(loaded.spec, torch.bfloat16), token_lists, exact),
        scaled=rms_error(load(loaded.spec, e4m3), token_lists, emulated),
        unscaled=rms_error(load(unscaled_spec, e4m3), token_lists, emulated),
    )
