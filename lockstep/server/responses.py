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
    """One choice: the prompt it was given and everything its engine request produced.
    `scores_only`: the request ran one token only to score its prompt (`max_tokens: 0`);
    that token is no part of the choice, which ends with finish reason "length"."""

    prompt_index: int
    prompt_ids: list[int]
    scores_only: bool = False
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

    def add(self, output: StepOutput) -> tuple[str, list[int], list[TokenLogprob]]:
        """Takes in one output; returns what it adds to the choice (text, token ids and their
        logprobs)."""
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.prompt_tokens = output.prompt_tokens
        self.cached_tokens = output.cached_tokens
        self.seed = output.seed
        if output.finished:
            self.finish_reason = "length" if self.scores_only else output.finish_reason
            self.stop_reason = None if self.scores_only else output.stop_reason
        if self.scores_only:
            return "", [], []
        self.text += output.new_text
        self.token_ids.extend(output.new_token_ids)
        if output.new_logprobs:
            self.logprobs.extend(output.new_logprobs)
        return output.new_text, list(output.new_token_ids), list(output.new_logprobs or ())


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


def token_label(tokenizer: Any, token_id: int, as_token_id: bool) -> str:
    """A token as logprobs show it: its text, or vLLM's `token_id:N` with
    `return_tokens_as_token_ids` (for tokens whose text alone does not identify them)."""
    return f"token_id:{token_id}" if as_token_id else tokenizer.token_str(token_id)


def completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    entries: list[TokenLogprob | None],
    text_offset: int,
    *,
    num_top: int | None = None,
    as_token_ids: bool = False,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object; `entries[i]` is None where no logprob exists
    (position 0 of an echoed prompt). `num_top`: alternatives shown per position (default:
    all an entry has; an echoed prompt may carry more, for `prompt_logprobs`)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = tokenizer.token_str(token_id)
        tokens.append(token_label(tokenizer, token_id, as_token_ids))
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(json_logprob(entry.logprob))
            top_logprobs.append(
                {
                    token_label(tokenizer, t, as_token_ids): json_logprob(lp)
                    for t, lp in entry.top[:num_top]
                }
            )
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _token_entry(tokenizer: Any, token_id: int, logprob: float, as_token_id: bool) -> dict:
    # A byte-level token may hold part of a UTF-8 sequence: its raw bytes, not its display text.
    text = tokenizer.token_str(token_id)
    raw = tokenizer.token_bytes(token_id) if hasattr(tokenizer, "token_bytes") else text.encode()
    label = token_label(tokenizer, token_id, as_token_id)
    return {"token": label, "logprob": json_logprob(logprob), "bytes": list(raw)}


def chat_logprobs(
    tokenizer: Any, entries: list[TokenLogprob], as_token_ids: bool = False
) -> dict[str, Any]:
    """Chat's `logprobs`; with `as_token_ids` each `token` is `token_id:N` and `bytes` stay
    the token's own, as in vLLM."""
    return {
        "content": [
            {
                **_token_entry(tokenizer, e.token_id, e.logprob, as_token_ids),
                "top_logprobs": [_token_entry(tokenizer, t, lp, as_token_ids) for t, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def vllm_prompt_logprobs(
    tokenizer: Any, entries: list[TokenLogprob | None], num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt position (null at position 0) a map from token id
    to `{"logprob", "rank", "decoded_token"}`, the prompt token first, then the `num_top`
    most likely tokens ranked 1..num_top (the prompt token, when among them, keeps its
    first place with their rank). Lockstep does not count the vocabulary: a prompt token
    outside the alternatives has rank null."""

    def item(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        decoded = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": decoded}

    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        top = entry.top[:num_top]
        ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
        position = {
            str(entry.token_id): item(entry.token_id, entry.logprob, ranks.get(entry.token_id))
        }
        for token_id, logprob in top:
            position.setdefault(str(token_id), item(token_id, logprob, ranks[token_id]))
        out.append(position)
    return out


def chunk_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """vLLM's per-chunk usage (`continuous_usage_stats`): one choice's counts so far."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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


def envelope(
    obj: str,
    group_id: str,
    created: int,
    model: str,
    system_fingerprint: str,
    choices: list[dict],
    **extra: Any,
) -> dict[str, Any]:
    """The fields every completion and chat completion body (or chunk) carries."""
    return {
        "id": group_id,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint,
        "choices": choices,
        **extra,
    }


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
