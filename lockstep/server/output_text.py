"""A request's text, made in the HTTP process from the token ids the engine process sends
(`Engine(detokenize=False)`), so that detokenization and stop strings never run in the step
loop.

The rules are `Engine._advance`'s and `Engine.abort_request`'s, on the same `TextOutput`
and tokenizer, so the text is the same and a stop string ends a request at the same token:
the output that completes it is the request's last (finished, reason "stop", the stop string
as its stop reason). The engine, which does not look for stop strings, runs that request on
until its abort arrives; the tokens it computes meanwhile reach no one.
"""

from __future__ import annotations

from typing import Any

from lockstep.engine.outputs import StepOutput
from lockstep.engine.sampling_params import SamplingParams
from lockstep.engine.text_output import TextOutput


class OutputText:
    """One engine request's text, fed its outputs in order."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> None:
        self._text = TextOutput(tokenizer, prompt_ids, params)
        self._min_tokens = params.min_tokens

    def fill(self, output: StepOutput) -> bool:
        """Set `output.new_text`, and end the request there when a stop string completes;
        returns True when that ended a request the engine still runs (abort it). An output
        may carry several tokens (held_outputs.py merges a request's outputs): they are
        pushed one by one, as their own outputs would have been, `hides_token` and `finished`
        applying to the last; a stop string cuts the output after the token completing it."""
        if not output.new_token_ids:  # an abort's closing output: what was held back
            output.new_text = self._text.push(None, final=True).text
            return False
        tokens = output.new_token_ids
        last = len(tokens) - 1
        texts = []
        for i, token in enumerate(tokens):
            delta = self._text.push(
                None if output.hides_token and i == last else token,
                final=output.finished and i == last,
                check_stops=output.completion_tokens - (last - i) >= self._min_tokens,
            )
            texts.append(delta.text)
            if delta.stop_string is not None:
                break
        output.new_text = "".join(texts)
        if delta.stop_string is None:
            return False
        if i < last:  # the tokens after the stop reach no one
            del output.new_token_ids[i + 1 :], output.new_token_logprobs[i + 1 :]
            if output.new_logprobs is not None:
                del output.new_logprobs[i + 1 :]
        engine_runs_on = not output.finished
        output.finished = True
        output.finish_reason = "stop"
        output.stop_reason = delta.stop_string
        return engine_runs_on
