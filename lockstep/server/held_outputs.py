"""Outputs of requests answered whole, held in the engine process until the request ends.

A request whose client takes the answer whole (not streamed) and that has no stop strings
(which the HTTP process checks token by token: output_text.py) needs its tokens only when it
ends. Sending every step's output of every such request to the HTTP process costs both
processes per-token work at every step: at 256 concurrent `/generate` requests that is 256
outputs a step to convert, pickle, unpickle, detokenize and route. Here the first output of
such a request is sent as it comes (its arrival is the time to first token in /metrics, and
the prompt logprobs ride on it); the later ones are merged into one output, sent when the
request ends or is closed (an abort's closing output). The merged output holds the same
tokens, logprobs and text, in order, as the outputs it replaces; consumers extend their lists
by each output's (native_api.py, responses.py), and `OutputText.fill` takes several tokens.
"""

from __future__ import annotations

import dataclasses

from lockstep.engine.outputs import StepOutput
from lockstep.engine.sampling_params import SamplingParams

# Fields a later output replaces (the request's state as of its last token).
_LATEST = (
    "finished", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens", "seed",
    "stop_reason", "hides_token", "routed_experts",
)  # fmt: skip


class HeldOutputs:
    """Which requests are answered whole, and their outputs held since the first."""

    def __init__(self) -> None:
        self._first_sent: dict[str, bool] = {}
        self._held: dict[str, StepOutput] = {}

    def track(self, request_id: str, params: SamplingParams, stream: bool) -> None:
        """Hold the outputs of `request_id` past its first where it is not streamed and has
        no stop strings."""
        if not stream and not params.stop:
            self._first_sent[request_id] = False

    def pass_on(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """The outputs to send now: every output of an untracked request, a tracked one's
        first, and its merged outputs once it has finished."""
        if not self._first_sent:
            return outputs
        sent: list[StepOutput] = []
        for out in outputs:
            rid = out.request_id
            first_sent = self._first_sent.get(rid)
            if first_sent is None:
                sent.append(out)
            elif out.finished:
                del self._first_sent[rid]
                sent.append(_merged(self._held.pop(rid, None), out))
            elif not first_sent:
                self._first_sent[rid] = True
                sent.append(out)
            else:
                self._held[rid] = _merged(self._held.get(rid), out)
        return sent

    def close(self, request_id: str, closing: StepOutput | None) -> StepOutput | None:
        """A request's closing output (an abort's), with what was held before it; forgets
        the request. None stays None where nothing was held."""
        self._first_sent.pop(request_id, None)
        held = self._held.pop(request_id, None)
        if held is None or closing is None:
            return closing if held is None else held
        return _merged(held, closing)

    def __len__(self) -> int:
        return len(self._held)


def _merged(held: StepOutput | None, out: StepOutput) -> StepOutput:
    """`out` appended to `held` (a copy of `out` where nothing is held): lists extended in
    place, so holding n outputs costs O(n)."""
    if held is None:
        return dataclasses.replace(
            out,
            new_token_ids=list(out.new_token_ids),
            new_token_logprobs=list(out.new_token_logprobs),
            new_logprobs=None if out.new_logprobs is None else list(out.new_logprobs),
        )
    held.new_token_ids.extend(out.new_token_ids)
    held.new_token_logprobs.extend(out.new_token_logprobs)
    held.new_text += out.new_text
    if out.new_logprobs is not None:
        if held.new_logprobs is None:
            held.new_logprobs = []
        held.new_logprobs.extend(out.new_logprobs)
    for name in _LATEST:
        setattr(held, name, getattr(out, name))
    return held
