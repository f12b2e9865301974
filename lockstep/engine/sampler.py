"""Token selection that keeps the contract: a token at position t is a pure function of
(logits_t, the request's seed, t).

* Greedy picks the largest logit; ties go to the lowest token id.
* Sampling is Gumbel-max with a counter-based generator: the noise for token v at position t
  is a hash of (seed, t, v), so a request's draws never depend on its batch-mates, on how many
  draws happened before, or on any global RNG state.
* Everything between the logits and the choice uses only IEEE-754 basic operations (+, -, *, /,
  comparisons) on float64, which are correctly rounded on every device and code path; torch's
  exp/log are not used, because their vectorized and scalar paths may differ in the last bit
  and an element's path can depend on where it sits in the tensor. `_exp` and `_log` below are
  built from those basic operations.
* Filters (temperature, top-k, top-p, min-p) act on the tempered distribution, in that order
  of strictness; among equal scores the lower token id is kept first. Top-p sums
  probabilities in fixed point (`probability_units`), so its cutoff is an exact integer
  comparison.
* The torch functions here are the definition (`*_reference`); the float64 work runs in one
  kernel pass where one exists (Triton on CUDA, C++ on CPU), tested equal bit for bit.

Reported logprobs are the log-softmax of the raw logits (the `Ops` backend's deterministic
row kernel), independent of the sampling filters, so generation and teacher-forced scoring
report the same bits.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_LN2 = 0.6931471805599453
# Sampled rows chosen at once (the memory reservation's unit: lockstep/engine/memory.py).
SAMPLER_CHUNK_ROWS = 32
_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values < 2**32. The multiplier is below
    2**31 so no product overflows int64."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def _uniform(seeds: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """[R, n] float64 values in (0, 1): row r, column v is a pure function of (seeds[r],
    positions[r], v). Only integer operations, so rows never depend on each other."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _hash32(positions & _MASK32)
    key = _hash32(key ^ hi)
    key = _hash32(key ^ lo)
    idx = torch.arange(n, dtype=torch.int64, device=seeds.device)
    a = _hash32(_hash32(idx)[None, :] ^ key[:, None])
    b = _hash32(a ^ 0x5BD1E995)
    # 53 random bits: 32 from a, 21 from b; +0.5 keeps the value strictly inside (0, 1).
    bits = a.to(torch.float64) * 2.0**21 + (b >> 11).to(torch.float64)
    return (bits + 0.5) / 2.0**53


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp for float64 x <= 0 from basic operations: x = k ln2 + r, |r| <= ln2/2, a Taylor
    series for exp(r) (error < 1e-16 relative), then an exact scaling by 2**k."""
    x = x.clamp(min=-745.0)
    k = torch.round(x / _LN2)
    r = x - k * _LN2
    term = torch.ones_like(r)
    total = torch.ones_like(r)
    for i in range(1, 18):
        term = term * r / i
        total = total + term
    return torch.ldexp(total, k.to(torch.int32))


def _log(x: torch.Tensor) -> torch.Tensor:
    """log for float64 x > 0 from basic operations: x = m 2**e with m in [0.5, 1) (exact),
    log m = 2 atanh((m-1)/(m+1)) as a series in z**2 (|z| <= 1/3, 30 terms: error < 1e-16)."""
    m, e = torch.frexp(x)
    z = (m - 1.0) / (m + 1.0)
    z2 = z * z
    total = torch.zeros_like(z)
    for i in range(29, -1, -1):
        total = total * z2 + 1.0 / (2 * i + 1)
    return 2.0 * z * total + e.to(torch.float64) * _LN2


def gumbel_noise_reference(seeds: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """-log(-log(u)) for the counter-based uniforms of each row's (seed, position): the
    definition of the noise, in torch (~200 full-width float64 passes)."""
    return -_log(-_log(_uniform(seeds, positions, n)))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """`gumbel_noise_reference`'s values, bit for bit, from this device's kernel if it has one
    (`_kernels`), else from the reference itself."""
    kernels = _kernels(seeds.device)
    if kernels is None:
        return gumbel_noise_reference(seeds, positions, n)
    return kernels.gumbel_noise(seeds, positions, n)


# Top-p sums probabilities in fixed point: units of 2**-UNIT_BITS of the best token's
# probability, truncated, so that the sums are exact integers (V * 2**44 < 2**63 for V below
# 2**19, checked).
UNIT_BITS = 44


def probability_units_reference(x: torch.Tensor, unit_bits: int = UNIT_BITS) -> torch.Tensor:
    """int64 trunc(exp(x) * 2**unit_bits) for float64 x <= 0 (a score minus the row's best):
    the definition. x below -64, -inf and NaN (a row of -inf scores) count as -64: exp(-64) *
    2**44 < 1, so those tokens get 0 units (anything below -44 ln 2 = -30.5 does). `unit_bits`
    other than UNIT_BITS: tests only (62 keeps every bit of probabilities above 1/2)."""
    if x.dtype != torch.float64:
        raise ValueError(f"probability units are defined on float64 scores, not {x.dtype}")
    x = torch.where(x >= -64.0, x, -64.0)
    return (_exp(x) * 2.0**unit_bits).to(torch.int64)


def probability_units(x: torch.Tensor, unit_bits: int = UNIT_BITS) -> torch.Tensor:
    """`probability_units_reference`'s values, bit for bit, from this device's kernel if it
    has one (`_kernels`), else from the reference itself."""
    kernels = _kernels(x.device)
    if kernels is None:
        return probability_units_reference(x, unit_bits)
    return kernels.probability_units(x.contiguous(), unit_bits)


_KERNELS: dict[str, ModuleType | None] = {}


def _kernels(device: torch.device) -> ModuleType | None:
    """The module whose `gumbel_noise(seeds, positions, n)` and `probability_units(x,
    unit_bits)` run the sampler's float64 work in one pass each on this device, bit for bit
    the references (tested): `lockstep.ops.triton.sampling` on CUDA, the C++ kernels on CPU
    (built on first use if no engine has built them yet, whatever the mode). Chosen once per
    device type. None: the torch references (~200 full-width passes; same bits, much slower),
    with a warning saying why."""
    if device.type in _KERNELS:
        return _KERNELS[device.type]
    kernels, why = None, "no kernels for this device"
    if device.type == "cuda":
        try:
            from lockstep.ops.triton import sampling as kernels
        except ImportError as exc:
            why = f"triton is missing ({exc})"
    elif device.type == "cpu":
        from lockstep.ops.cpu_build import KernelBuildError, load_extension

        try:
            kernels = load_extension()
        except KernelBuildError as exc:
            why = str(exc)
    if kernels is None:
        logger.warning("sampler on %s: the torch reference computes the noise and top-p's "
                       "probabilities, same bits but much slower: %s", device.type, why)  # fmt: skip
    _KERNELS[device.type] = kernels
    return kernels


def warm_up(device: torch.device, vocab: int) -> None:
    """Run one sampled row with top-k and top-p: chooses (and on CPU builds or loads) this
    device's sampler kernels, compiles them and uploads their constants now, so the first
    sampled request waits for none of it."""
    logits = torch.zeros((1, vocab), dtype=torch.float32, device=device)
    choose_token_tensor(logits, [RowSampling(1.0, 2, 0.5, 0.0, 0, 0)])


@dataclass(frozen=True)
class RowSampling:
    """How to choose the token of one logits row. `position` is the absolute position the
    chosen token will occupy."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    position: int


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely tokens of one row, by descending logprob, ties by ascending id."""
    if k <= 0:
        return ()
    values, ids = torch.sort(logprobs, descending=True, stable=True)
    return tuple(
        (int(i), float(v)) for i, v in zip(ids[:k].tolist(), values[:k].tolist(), strict=True)
    )


def choose_token_tensor(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Pick one token per row of raw float32 logits [R, V], as an int64 tensor on the logits'
    device, without waiting for the device: sampled rows' parameters (seeds, positions,
    temperatures) go over by asynchronous copies and filters stay on the device. Greedy
    rows take the argmax (ties: lowest id); sampled rows take the
    argmax of tempered scores plus counter-based Gumbel noise over the tokens their filters
    keep. Work is batched across rows, but every operation is elementwise or a per-row
    reduction, so a row's token never depends on the other rows."""
    # torch.argmax returns the first maximal index: ties go to the lowest token id.
    tokens = torch.argmax(logits, dim=1)
    sampled = [i for i, r in enumerate(rows) if r.temperature > 0.0]
    # In chunks of SAMPLER_CHUNK_ROWS rows: the float64 scratch is sized by the chunk, not by
    # the batch (lockstep/engine/memory.py reserves it); every operation is per row, so the
    # chunking changes no token.
    for at in range(0, len(sampled), SAMPLER_CHUNK_ROWS):
        part = sampled[at : at + SAMPLER_CHUNK_ROWS]
        index = _to_device(part, torch.int64, logits.device)
        tokens[index] = _sample_rows(logits.index_select(0, index), [rows[i] for i in part])
    return tokens


def _sample_rows(logits: torch.Tensor, chosen: list[RowSampling]) -> torch.Tensor:
    """Tokens of sampled rows (temperature > 0): the argmax of tempered scores plus their
    counter-based Gumbel noise over the tokens the filters keep."""
    device = logits.device
    temps = _to_device([r.temperature for r in chosen], torch.float64, device)
    scores = logits.to(torch.float64) / temps[:, None]
    keep = _filter_mask(scores, chosen)
    seeds = _to_device([r.seed for r in chosen], torch.int64, device)
    positions = _to_device([r.position for r in chosen], torch.int64, device)
    noisy = scores + gumbel_noise(seeds, positions, scores.shape[1])
    noisy = torch.where(keep, noisy, torch.full_like(noisy, -math.inf))
    return torch.argmax(noisy, dim=1)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the device: through pinned memory
    and an asynchronous copy on CUDA (a pageable copy would wait for every kernel already
    queued, e.g. a decode step launched ahead)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _filter_mask(scores: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Which tokens each tempered row keeps after top-k, min-p and top-p (in that order).
    Each filter runs once over the rows that use it; every step is exact whatever the batch:
    k-th largest values (values, not an order), sorted values, elementwise operations, sums of
    booleans and integer prefix sums. So a row's mask never depends on the other rows."""
    v = scores.shape[1]
    if v >= 1 << (63 - UNIT_BITS):
        raise ValueError(f"vocabulary of {v} tokens: top-p's fixed-point sums need < 2**19")
    device = scores.device
    keep = torch.ones_like(scores, dtype=torch.bool)
    best = scores.max(dim=1, keepdim=True).values
    k_rows = [i for i, r in enumerate(rows) if 0 < r.top_k < v]
    if k_rows:
        index = _to_device(k_rows, torch.int64, device)
        ks = _to_device([rows[i].top_k for i in k_rows], torch.int64, device)[:, None]
        picked = scores[index]
        top = torch.topk(picked, max(rows[i].top_k for i in k_rows), dim=1).values
        keep[index] = _first_k(picked, ks, top.gather(1, ks - 1))
    min_p_rows = [i for i, r in enumerate(rows) if r.min_p > 0.0]
    if min_p_rows:
        index = _to_device(min_p_rows, torch.int64, device)
        logs = _to_device([math.log(rows[i].min_p) for i in min_p_rows], torch.float64, device)
        keep[index] &= scores[index] >= best[index] + logs[:, None]
    p_rows = [i for i, r in enumerate(rows) if r.top_p < 1.0]
    if p_rows:
        index = _to_device(p_rows, torch.int64, device)
        top_p = _to_device([rows[i].top_p for i in p_rows], torch.float64, device)
        masked = torch.where(keep[index], scores[index], -math.inf)
        counts, kth = _top_p_cutoff(masked, best[index], top_p[:, None])
        keep[index] &= _first_k(masked, counts, kth)
    return keep


def _first_k(scores: torch.Tensor, ks: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
    """The first ks[r] tokens of row r in a stable descending sort (ties to the lower id),
    given kth[r], the ks[r]-th largest value: every token above it, then the lowest-id tokens
    equal to it. Values and counts only, so the same for any sort algorithm."""
    above = scores > kth
    ties = scores == kth
    tie_rank = torch.cumsum(ties.to(torch.int64), dim=1)
    return above | (ties & (tie_rank <= ks - above.sum(dim=1, keepdim=True)))


def _top_p_cutoff(
    masked: torch.Tensor, best: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p's kept count per row and the value at that rank (`_top_p_cutoff_by_sort`). On the
    CPU the C++ kernel finds them by a weighted selection instead of a sort (the same exact
    integers, tested equal); elsewhere the sort."""
    kernels = _kernels(masked.device) if masked.device.type == "cpu" else None
    if kernels is not None:
        counts, kth = kernels.top_p_cutoff(masked.contiguous(), best, top_p.flatten(), UNIT_BITS)
        return counts, kth
    return _top_p_cutoff_by_sort(masked, best, top_p)


def _top_p_cutoff_by_sort(
    masked: torch.Tensor, best: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p's kept count per row and the value at that rank: the shortest prefix of the
    row's values, largest first, whose units reach ceil(top_p * T), T the row's total units
    (the tokens the earlier filters kept); at least one token. Units are exact integers, so
    no summation order can move the cutoff; since ceil(top_p * T) <= T, the prefix never
    reaches a token without units (one the earlier filters dropped, or below 2**-44 of the
    best token's probability). Only values are sorted: the order among equal values changes
    no prefix sum, and `_first_k` breaks the ties. Nothing is read back to the host."""
    ordered = torch.sort(masked, dim=1, descending=True).values
    cumulative = torch.cumsum(probability_units(ordered - best), dim=1)
    total = cumulative[:, -1:]
    # ceil(T * top_p) <= T but for the rounding of T to a double (T near 2**62): at most T.
    target = torch.minimum(torch.ceil(total.to(torch.float64) * top_p).to(torch.int64), total)
    counts = (cumulative < target).sum(dim=1, keepdim=True) + 1
    return counts, ordered.gather(1, counts - 1)
