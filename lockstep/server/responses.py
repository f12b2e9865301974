"""Response bodies in OpenAI's shapes, built from engine outputs.

`ChoiceState` accumulates one choice (one engine request) across its `StepOutput`s; the
functions below turn deltas or whole choices into completion, chat and streaming chunk dicts.
Logprob floats pass through unchanged (JSON round-trips a Python float exactly), which is what
lets a client compare `/v1/score` with generation logprobs bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lockstep.engine.outputs import StepOutput, TokenLogprob

# JSON has no -Infinity. OpenAI writes an impossible token's logprob as -9999.0; so do we.
# Finite values pass through untouched (bit-exact).
IMPOSSIBLE_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    return IMPOSSIBLE_LOGPROB if value == float("-inf") else value


@dataclass
class ChoiceState:
    """One choice: the prompt it was given and everything its engine request produced."""

    prompt_index: int
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seed: int | None = None
    started: bool = False  # whether a stream already sent its opening chunk

    def add(self, output: StepOutput) -> None:
        self.text += output.new_text
        self.token_ids.extend(output.new_token_ids)
        if output.new_logprobs:
            self.logprobs.extend(output.new_logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.prompt_tokens = output.prompt_tokens
        self.cached_tokens = output.cached_tokens
        self.seed = output.seed
        if output.finished:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason


def usage(choices: list[ChoiceState]) -> dict[str, Any]:
    """OpenAI counts a prompt once however many choices it has; cached tokens are those of the
    prompt's first choice (later choices may hit the cache the first one filled)."""
    firsts: dict[int, ChoiceState] = {}
    for choice in choices:
        firsts.setdefault(choice.prompt_index, choice)
    prompt_tokens = sum(c.prompt_tokens for c in firsts.values())
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts.values())},
    }


def completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    entries: list[TokenLogprob | None],
    text_offset: int,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object; `entries[i]` is None where no logprob exists
    (position 0 of an echoed prompt)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = tokenizer.token_str(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(json_logprob(entry.logprob))
            top_logprobs.append({tokenizer.token_str(t): json_logprob(lp) for t, lp in entry.top})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _token_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.token_str(token_id)
    # A byte-level token may hold part of a UTF-8 sequence: its raw bytes, not its display text.
    raw = tokenizer.token_bytes(token_id) if hasattr(tokenizer, "token_bytes") else text.encode()
    return {"token": text, "logprob": json_logprob(logprob), "bytes": list(raw)}


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                **_token_entry(tokenizer, e.token_id, e.logprob),
                "top_logprobs": [_token_entry(tokenizer, t, lp) for t, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def score_entry(
    tokenizer: Any, index: int, choice: ChoiceState, top_logprobs: int
) -> dict[str, Any]:
    entries = choice.prompt_logprobs or [None] * len(choice.prompt_ids)
    data: dict[str, Any] = {
        "index": index,
        "token_ids": choice.prompt_ids,
        "tokens": [tokenizer.token_str(t) for t in choice.prompt_ids],
        "logprobs": [None if e is None else json_logprob(e.logprob) for e in entries],
    }
    if top_logprobs:
        data["top_logprobs"] = [
            None
            if e is None
            else [
                {"token_id": t, "token": tokenizer.token_str(t), "logprob": json_logprob(lp)}
                for t, lp in e.top
            ]
            for e in entries
        ]
    return data


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
