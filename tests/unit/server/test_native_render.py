"""The native /generate stream renders only what is new: each event adds the new tokens'
logprob entries to those kept from earlier events (the prompt's once), so a stream of n
events decodes O(n) token texts, not O(n^2), and every event equals a full render."""

from __future__ import annotations

from types import SimpleNamespace

from lockstep.engine.outputs import StepOutput, TokenLogprob
from lockstep.server.native_api import _Item, _render
from lockstep.server.native_protocol import NativeSamplingParams

PROMPT = [5, 6, 7, 8]
STEPS = 40
TOP = 2


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:  # noqa: ARG002
        self.calls += 1
        return f"<{ids[0]}>"


def _served(tok: CountingTokenizer) -> SimpleNamespace:
    return SimpleNamespace(tokenizer=tok, engine=SimpleNamespace(weight_version="w0"))


def _item() -> _Item:
    return _Item("r", "r", list(PROMPT), NativeSamplingParams(max_new_tokens=STEPS), True, 0, TOP)


def _output(step: int) -> StepOutput:
    t = 100 + step
    lp = TokenLogprob(t, -0.5 - step, ((t, -0.5 - step), (t + 1, -1.5 - step)))
    prompt = [None] + [TokenLogprob(p, -2.0, ((p, -2.0), (1, -3.0))) for p in PROMPT[1:]]
    return StepOutput("r", [t], f"<{t}>", [lp], step == STEPS - 1, "length" if step == STEPS - 1
                      else None, len(PROMPT), 0, step + 1, 0,
                      prompt_logprobs=prompt if step == 0 else None,
                      new_token_logprobs=[lp.logprob])  # fmt: skip


def _without_latency(event: dict) -> dict:
    event["meta_info"].pop("e2e_latency")
    return event


def test_a_stream_renders_each_token_once_and_every_event_equals_a_full_render() -> None:
    tok, fresh_tok = CountingTokenizer(), CountingTokenizer()
    item = _item()
    for step in range(STEPS):
        item.add(_output(step))
        event = _render(_served(tok), item, 0.0, True)
        # A full render of the same outputs on an item that never rendered before.
        full = _item()
        for s in range(step + 1):
            full.add(_output(s))
        assert _without_latency(event) == _without_latency(_render(_served(fresh_tok), full,
                                                                     0.0, True))  # fmt: skip
    per_token = 1 + TOP  # its entry and its alternatives
    assert tok.calls == (STEPS + len(PROMPT)) * per_token - TOP  # the first prompt row: none
    # Control: rendering every event from scratch (what the full renders above did) decodes
    # every earlier token again, quadratically.
    assert fresh_tok.calls > 10 * tok.calls
