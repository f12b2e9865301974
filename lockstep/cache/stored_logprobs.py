"""Logprobs stored with cached KV: for a run of consecutive positions of one token path, the
logprob of the token at each position p given the tokens before it, and its top alternatives.

By the contract (docs/design.md) the logits of position p-1 are a pure function of tokens
0..p-1, so the logprob of token p, read from them, is a pure function of tokens 0..p: it can be
cached keyed by the same token path as the KV of position p, and served instead of recomputed.

Per position i of a `StoredLogprobs` of length n:

    num_top[i] == -1   nothing stored (the logprob was never computed)
    num_top[i] == k    logprob[i] is stored, and columns 0..k-1 of top_ids / top_logprobs hold
                       the k most likely tokens of that distribution, by descending logprob,
                       ties by ascending id (`sampler.top_logprobs`); columns k.. are padding
                       (id -1, logprob NaN)

A run with k alternatives answers every ask of k or fewer; an ask of more is a miss. At most
`MAX_STORED_TOP` alternatives are kept per position: the API's own maximum, so nothing a
request computed is dropped, at 8 bytes per alternative (160 bytes for 20) beside the tens of
kilobytes of KV a position holds on the smallest model.

Values are float32: the `Ops.log_softmax` contract (`lockstep/ops/base.py`), so a value taken
from a log-softmax row, as a Python float or a tensor, is stored and read back exactly.
`from_rows` refuses one that is not a float32 value rather than round it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

__all__ = ["MAX_STORED_TOP", "ScoredToken", "StoredLogprobs"]

MAX_STORED_TOP = 20


class ScoredToken(Protocol):
    """What `from_rows` reads from one position (an `engine.outputs.TokenLogprob` has it)."""

    @property
    def logprob(self) -> float: ...

    @property
    def top(self) -> Sequence[tuple[int, float]]: ...


class StoredLogprobs:
    """Stored logprobs of consecutive positions; see the module docstring for the layout.

    Instances are values: every method returns new tensors and never changes `self`."""

    __slots__ = ("logprob", "num_top", "top_ids", "top_logprobs")

    def __init__(
        self,
        logprob: torch.Tensor,
        num_top: torch.Tensor,
        top_ids: torch.Tensor,
        top_logprobs: torch.Tensor,
    ) -> None:
        self.logprob = logprob  # float32 [n]
        self.num_top = num_top  # int8 [n]
        self.top_ids = top_ids  # int32 [n, w], w >= every num_top
        self.top_logprobs = top_logprobs  # float32 [n, w]

    # ---- construction --------------------------------------------------------------------

    @staticmethod
    def empty(n: int, width: int = 0) -> StoredLogprobs:
        """n positions with nothing stored."""
        return StoredLogprobs(
            torch.full((n,), math.nan, dtype=torch.float32),
            torch.full((n,), -1, dtype=torch.int8),
            torch.full((n, width), -1, dtype=torch.int32),
            torch.full((n, width), math.nan, dtype=torch.float32),
        )

    @staticmethod
    def from_rows(rows: Sequence[ScoredToken | None]) -> StoredLogprobs:
        """One position per row: None stores nothing; a row stores its logprob and its first
        `MAX_STORED_TOP` alternatives. Raises ValueError for a value that is not float32."""
        n = len(rows)
        width = max((min(len(r.top), MAX_STORED_TOP) for r in rows if r is not None), default=0)
        out = StoredLogprobs.empty(n, width)
        known = [i for i, r in enumerate(rows) if r is not None]
        if not known:
            return out
        values = torch.tensor([rows[i].logprob for i in known], dtype=torch.float64)
        index = torch.tensor(known, dtype=torch.int64)
        out.logprob[index] = _exact_float32(values, "logprob")
        tops = [rows[i].top[:MAX_STORED_TOP] for i in known]
        out.num_top[index] = torch.tensor([len(t) for t in tops], dtype=torch.int8)
        if width:
            ids = [[t[0] for t in top] + [-1] * (width - len(top)) for top in tops]
            lps = [[t[1] for t in top] + [math.nan] * (width - len(top)) for top in tops]
            out.top_ids[index] = torch.tensor(ids, dtype=torch.int32)
            out.top_logprobs[index] = _exact_float32(
                torch.tensor(lps, dtype=torch.float64), "top logprob"
            )
        return out

    @staticmethod
    def cat(parts: Sequence[StoredLogprobs]) -> StoredLogprobs:
        """The parts one after the other (widths padded to the widest)."""
        if not parts:
            return StoredLogprobs.empty(0)
        width = max(p.width for p in parts)
        padded = [p.widened(width) for p in parts]
        return StoredLogprobs(
            torch.cat([p.logprob for p in padded]),
            torch.cat([p.num_top for p in padded]),
            torch.cat([p.top_ids for p in padded]),
            torch.cat([p.top_logprobs for p in padded]),
        )

    # ---- reading -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_top.shape[0]

    @property
    def width(self) -> int:
        """Alternative columns held (some may be padding)."""
        return self.top_ids.shape[1]

    def slice(self, start: int, end: int, width: int | None = None) -> StoredLogprobs:
        """Positions start..end-1 as an independent copy; `width`: keep only that many
        alternative columns (callers cut to what every position in the range holds)."""
        w = self.width if width is None else width
        return StoredLogprobs(
            self.logprob[start:end].clone(),
            self.num_top[start:end].clone(),
            self.top_ids[start:end, :w].clone(),
            self.top_logprobs[start:end, :w].clone(),
        )

    def widened(self, width: int) -> StoredLogprobs:
        """The same positions with at least `width` alternative columns (padding added)."""
        extra = width - self.width
        if extra <= 0:
            return self
        n = len(self)
        return StoredLogprobs(
            self.logprob,
            self.num_top,
            torch.cat([self.top_ids, torch.full((n, extra), -1, dtype=torch.int32)], dim=1),
            torch.cat(
                [self.top_logprobs, torch.full((n, extra), math.nan, dtype=torch.float32)], dim=1
            ),
        )

    def first_short(self, start: int, num_top: int) -> int:
        """The first position at or after `start` that does not hold a logprob with at least
        `num_top` alternatives; len(self) if there is none."""
        short = (self.num_top[start:] < num_top).nonzero()
        return start + int(short[0, 0]) if short.numel() else len(self)

    def rows(self, num_top: int) -> Iterator[tuple[float, tuple[tuple[int, float], ...]]]:
        """(logprob, first `num_top` alternatives) per position, as Python values; every
        position must hold at least `num_top` (ValueError otherwise)."""
        if len(self) and int(self.num_top.min()) < num_top:
            raise ValueError(f"StoredLogprobs.rows({num_top}): a position holds fewer")
        ids = self.top_ids[:, :num_top].tolist()
        lps = self.top_logprobs[:, :num_top].tolist()
        for value, row_ids, row_lps in zip(self.logprob.tolist(), ids, lps, strict=True):
            yield value, tuple(zip(row_ids, row_lps, strict=True))

    # ---- combining -----------------------------------------------------------------------

    def merged(self, other: StoredLogprobs, at: int) -> StoredLogprobs:
        """Positions at..at+len(other)-1 take `other`'s row where it holds more alternatives
        (a stored logprob beats none). By the contract two rows of one position agree on every
        value they both hold, so this only ever adds information. Returns `self` unchanged
        when `other` adds nothing."""
        end = at + len(other)
        better = other.num_top > self.num_top[at:end]
        if not bool(better.any()):
            return self
        width = max(self.width, int(other.num_top[better].max()))
        out = self.widened(width).slice(0, len(self))
        src = other.widened(width)
        index = better.nonzero().flatten()
        out.logprob[at + index] = src.logprob[index]
        out.num_top[at + index] = src.num_top[index]
        out.top_ids[at + index] = src.top_ids[index, :width]
        out.top_logprobs[at + index] = src.top_logprobs[index, :width]
        return out

    # ---- integrity -----------------------------------------------------------------------

    def problems(self, tokens: Sequence[int]) -> list[str]:
        """What is wrong with these rows as the stored logprobs of `tokens` (empty: nothing
        found). Beyond shapes and padding, where alternatives are stored each row is checked
        against its own token: sorted, distinct, the token's alternative equal to its logprob,
        and a token more likely than the last alternative present among them. A logprob
        stored at the wrong position, or altered, fails these wherever alternatives exist;
        a row without alternatives carries nothing to check it against."""
        n, w = len(self), self.width
        if (
            self.logprob.dtype != torch.float32
            or self.num_top.dtype != torch.int8
            or self.top_ids.dtype != torch.int32
            or self.top_logprobs.dtype != torch.float32
            or self.logprob.shape != (n,)
            or self.top_ids.shape != (n, w)
            or self.top_logprobs.shape != (n, w)
        ):
            return [f"malformed tensors {self!r}"]
        if n != len(tokens):
            return [f"{n} stored rows for {len(tokens)} tokens"]
        if w > MAX_STORED_TOP:
            return [f"{w} alternative columns > MAX_STORED_TOP {MAX_STORED_TOP}"]
        found: list[str] = []
        k = self.num_top.to(torch.int64)
        bad = ((k < -1) | (k > w)).nonzero().flatten()
        if bad.numel():
            return [f"alternative counts outside [-1, {w}] at rows {bad.tolist()[:8]}"]
        valid = torch.arange(w)[None, :] < k[:, None]
        if bool((self.top_ids[~valid] != -1).any()):
            found.append("padding alternatives with ids other than -1")
        ids, lps = self.top_ids.to(torch.int64), self.top_logprobs
        if w > 1:
            pair = valid[:, 1:]
            ordered = (lps[:, :-1] > lps[:, 1:]) | (
                (lps[:, :-1] == lps[:, 1:]) & (ids[:, :-1] < ids[:, 1:])
            )
            nan = lps[:, :-1].isnan() | lps[:, 1:].isnan()
            unsorted = (pair & ~ordered & ~nan).any(dim=1).nonzero().flatten()
            if unsorted.numel():
                found.append(f"alternatives out of order at rows {unsorted.tolist()[:8]}")
            # Distinct ids: padding made unique (-1 - column) so only real repeats collide.
            keyed = torch.where(valid, ids, -1 - torch.arange(w)[None, :])
            s = keyed.sort(dim=1).values
            repeats = (s[:, 1:] == s[:, :-1]).any(dim=1).nonzero().flatten()
            if repeats.numel():
                found.append(f"an alternative listed twice at rows {repeats.tolist()[:8]}")
        if w:
            token = torch.tensor(list(tokens), dtype=torch.int64)
            hit = valid & (ids == token[:, None])
            has = hit.any(dim=1)
            own = torch.where(hit, lps, 0.0).sum(dim=1)  # the one hit column's value
            value = self.logprob
            wrong = has & (own != value) & ~value.isnan()
            rows = wrong.nonzero().flatten()
            if rows.numel():
                found.append(f"the token's alternative differs from its logprob at rows "
                             f"{rows.tolist()[:8]}")  # fmt: skip
            last = (k - 1).clamp(min=0)
            last_lp = lps.gather(1, last[:, None])[:, 0]
            last_id = ids.gather(1, last[:, None])[:, 0]
            above = (value > last_lp) | ((value == last_lp) & (token < last_id))
            missing = ((k > 0) & ~has & above).nonzero().flatten()
            if missing.numel():
                found.append(f"a logprob above the last alternative's is not among them at rows "
                             f"{missing.tolist()[:8]}")  # fmt: skip
        return found

    def __repr__(self) -> str:
        return (
            f"StoredLogprobs(n={len(self)}, width={self.width}, "
            f"stored={int((self.num_top >= 0).sum())})"
        )


def _exact_float32(values: torch.Tensor, what: str) -> torch.Tensor:
    """float64 values as float32, refusing any that float32 does not hold exactly."""
    out = values.to(torch.float32)
    lost = (out.to(torch.float64) != values) & ~values.isnan()
    if bool(lost.any()):
        raise ValueError(
            f"StoredLogprobs: {what} {float(values[lost][0])!r} is not a float32 value "
            "(log-softmax rows are float32)"
        )
    return out
