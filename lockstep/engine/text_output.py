"""Incremental text for one request: detokenization and stop strings.

Text is released as soon as it can no longer become part of a stop string: the longest tail
of the pending text that is a prefix of some stop string is held back until the next token
decides it. When a stop string appears, the text before it is released (plus the stop string
itself with `include_stop_str_in_output`) and the request finishes with reason "stop".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lockstep.engine.sampling_params import SamplingParams
from lockstep.models.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class TextDelta:
    text: str  # newly released text
    stop_string: str | None  # the stop string found, if any (the request then finishes)


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.pending = ""
        self.released = ""
        self.stopped = False

    def push(self, token: int | None, final: bool, check_stops: bool = True) -> TextDelta:
        """Add one generated token (None: a token whose text is not output, such as EOS).
        `final` flushes everything still held back. `check_stops` False (an output shorter
        than min_tokens): stop strings are not looked for, and nothing is held back."""
        if self.stopped:
            return TextDelta("", None)
        if token is not None:
            self.pending += self.detokenizer.push([token])
        if final:
            self.pending += self.detokenizer.flush()
        found = self._find_stop() if check_stops else None
        if found is not None:
            index, stop = found
            out = self.pending[: index + (len(stop) if self.include_stop else 0)]
            self.pending = ""
            self.stopped = True
            return self._release(out, stop)
        if final:
            out, self.pending = self.pending, ""
            return self._release(out, None)
        hold = self._held_back_length() if check_stops else 0
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return self._release(out, None)

    def _release(self, text: str, stop: str | None) -> TextDelta:
        self.released += text
        return TextDelta(text, stop)

    def _find_stop(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = self.pending.find(stop)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _held_back_length(self) -> int:
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest
