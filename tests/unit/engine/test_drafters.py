"""The n-gram (prompt lookup) drafter, the options that turn speculation on (`LLM`, the CLI),
and the scheduler's part: drafts only from spare slots, given back after the step."""

from __future__ import annotations

import argparse
import random

import pytest

from lockstep.cli_options import add_engine_arguments, engine_options_from_args
from lockstep.config import EngineConfig
from lockstep.engine.drafters import NgramDrafter, make_drafter
from lockstep.engine.sampling_params import SamplingParams


def _naive(tokens: list[int], limit: int, min_n: int, max_n: int) -> list[int]:
    """The drafter's rule written as plain loops: the longest n first; among earlier
    occurrences of the last n tokens, the latest with `limit` tokens after it, else the
    latest."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        starts = [j for j in range(length - n) if tokens[j : j + n] == suffix]
        if starts:
            full = [j for j in starts if j + n + limit <= length]
            j = (full or starts)[-1]
            return tokens[j + n : j + n + limit]
    return []


def test_ngram_proposes_what_followed_the_last_match() -> None:
    drafter = NgramDrafter(1, 3)
    assert drafter.propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]  # "2 3" matched
    assert drafter.propose([1, 2, 3, 4, 5, 9, 2, 3], 1) == [4]
    assert drafter.propose([7, 8, 9], 4) == []  # nothing repeats
    # The latest match with a full continuation wins over an earlier one.
    assert drafter.propose([5, 1, 2, 5, 3, 4, 5], 2) == [3, 4]
    # The longest n first: "1 2 5" recurs only once, so it decides over the shorter "5".
    assert drafter.propose([1, 2, 5, 7, 7, 5, 8, 8, 1, 2, 5], 2) == [7, 7]
    assert NgramDrafter(2, 2).propose([3, 1, 9, 1], 2) == []  # "9 1" never seen before


def test_ngram_matches_its_plain_loop_definition() -> None:
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        limit, lo = rng.randint(1, 6), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        assert NgramDrafter(lo, hi).propose(tokens, limit) == _naive(tokens, limit, lo, hi)


def test_drafter_and_option_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="min_n=3, max_n=2"):
        NgramDrafter(3, 2)
    with pytest.raises(ValueError, match="speculative='draft' is invalid"):
        make_drafter("draft", 1, 2)


def test_cli_flags_and_llm_options_turn_speculation_on() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    argv = ["--speculative", "ngram", "--num-draft-tokens", "6", "--prompt-lookup-min", "1"]
    options = engine_options_from_args(parser.parse_args(argv))
    config = EngineConfig.from_options(**options)
    assert (config.speculative, config.num_draft_tokens, config.prompt_lookup_min) == (
        "ngram", 6, 1,
    )  # fmt: skip
    assert engine_options_from_args(parser.parse_args([]))["speculative"] is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative", "eagle"])

    from lockstep import LLM

    llm = LLM("random:tiny", device="cpu", kv_tokens=512, speculative="ngram", num_draft_tokens=3)
    assert llm.engine.speculator is not None and llm.engine.speculator.num_draft_tokens == 3
    prompt = [5, 6, 7, 8] * 6
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    plain = LLM("random:tiny", device="cpu", kv_tokens=512)
    want = plain.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert out[0].token_ids == want[0].token_ids
    stats = llm.engine.stats()
    assert (
        stats["spec_verify_chunks_total"] > 0
        and plain.engine.stats()["spec_drafted_tokens_total"] == 0
    )


def test_drafts_take_only_spare_slots_and_are_given_back() -> None:
    """With a pool that holds the running requests and little more, drafts shrink to what is
    spare rather than evicting or preempting; after every step the request owns exactly its
    computed positions (integrity checked after each step)."""
    from lockstep.engine.engine import Engine

    engine = Engine(EngineConfig(model="random:tiny", device="cpu", kv_tokens=64,
                                 debug_checks=True, speculative="ngram", num_draft_tokens=8,
                                 prompt_lookup_min=1, enable_prefix_cache=False))  # fmt: skip
    prompt = [3, 4] * 10
    engine.add_request("a", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    widest = 0
    while engine.has_unfinished():
        engine.step()
        chunks = [part.chunk for part in engine._last_layout]
        widest = max([widest, *(len(c.draft) for c in chunks)])
        for chunk in chunks:
            request = chunk.request
            if request.request_id in engine.requests:
                assert len(request.slots) == request.num_computed == request.num_tokens - 1
    assert widest > 0 and engine.scheduler.num_preemptions == 0
    assert engine.pool.num_free == engine.pool.num_slots


def test_draft_rows_share_the_prompt_logprob_row_bound() -> None:
    """Draft rows need logits like prompt-logprob rows do, and the step's logits workspace is
    reserved for PROMPT_LOGPROB_ROWS of them beside the sampling rows: a step never drafts
    more than what that bound leaves (here cut to 3, with 4 requests each wanting 4 drafts)."""
    from lockstep.engine.engine import Engine

    engine = Engine(EngineConfig(model="random:tiny", device="cpu", kv_tokens=1024,
                                 speculative="ngram", num_draft_tokens=4,
                                 prompt_lookup_min=1))  # fmt: skip
    engine.scheduler.prompt_logprob_rows = 3
    for i in range(4):
        engine.add_request(f"r{i}", [3 + i, 4] * 12, SamplingParams(max_tokens=24, temperature=0,
                                                                    ignore_eos=True))  # fmt: skip
    widest = 0
    while engine.has_unfinished():
        engine.step()
        drafted = sum(len(part.chunk.draft) for part in engine._last_layout)
        assert drafted <= 3
        widest = max(widest, drafted)
    assert widest == 3
