"""Request preparation without a server: how many tokens a request without `max_tokens` may
generate, and the refusals that come before any engine work."""

from __future__ import annotations

import pytest

from lockstep.server.preparation import Served, max_tokens_for
from lockstep.server.protocol import APIError


def _served(max_model_len: int, kv_tokens: int) -> Served:
    return Served(engine=None, model_name="m", tokenizer=None, max_model_len=max_model_len,
                  vocab_size=10, created=0, system_fingerprint="", kv_tokens=kv_tokens)  # type: ignore[arg-type]  # fmt: skip


def test_absent_max_tokens_is_as_many_as_fit_the_context_and_the_pool() -> None:
    roomy = _served(max_model_len=512, kv_tokens=4096)
    assert max_tokens_for(roomy, None, 30, "prompt", "max_tokens") == 482  # the context
    small_pool = _served(max_model_len=512, kv_tokens=100)
    # n tokens hold n - 1 slots: 30 + 71 tokens need 100.
    assert max_tokens_for(small_pool, None, 30, "prompt", "max_tokens") == 71
    assert max_tokens_for(small_pool, None, 100, "prompt", "max_tokens") == 1
    with pytest.raises(APIError, match="KV pool holds 100") as refused:
        max_tokens_for(small_pool, None, 101, "prompt", "max_tokens")
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"
    # An explicit max_tokens is the client's: checked against the context here.
    assert max_tokens_for(small_pool, 200, 30, "prompt", "max_tokens") == 200
    with pytest.raises(APIError, match="maximum context length is 512"):
        max_tokens_for(small_pool, 500, 30, "prompt", "max_tokens")
