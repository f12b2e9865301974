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
        returns True when that ended a request the engine still runs (abort it)."""
        if not output.new_token_ids:  # an abort's closing output: what was held back
            output.new_text = self._text.push(None, final=True).text
            return False
        (token,) = output.new_token_ids  # the engine appends one token per output
        delta = self._text.push(
            None if output.hides_token else token,
            final=output.finished,
            check_stops=output.completion_tokens >= self._min_tokens,
        )
        output.new_text = delta.text
        if delta.stop_string is None:
            return False
        engine_runs_on = not output.finished
        output.finished = True
        output.finish_reason = "stop"
        output.stop_reason = delta.stop_string
        return engine_runs_on
