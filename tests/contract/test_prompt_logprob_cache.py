"""Prompt logprobs served from the prefix cache (lockstep/cache/radix.py, "Stored logprobs" and
"Scored match"): a request that asks for prompt logprobs reuses cached KV where the cache also
holds the logprobs it owes, and every logprob it returns, chosen and top-k, has the bits of a
cold full prefill's (an engine without a prefix cache).

Covered: hits of every length 1..n (n: identical prompts) after a scored or a generating
donor, with whole and chunked prefill; generate-then-score on policy; more alternatives asked
than stored; namespaces; random workloads under preemption and chunking. Negative controls: a
perturbed stored logprob and logprobs stored one position late both fail the same comparison;
check_integrity catches a stored logprob that disagrees with its token.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass

import pytest
import torch

from lockstep.cache import CacheIntegrityError, RadixCache
from lockstep.cache.stored_logprobs import StoredLogprobs
from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.llm import LLM
from lockstep.engine.outputs import TokenLogprob
from lockstep.engine.request import Request
from lockstep.engine.sampling_params import SamplingParams

Entries = list[TokenLogprob | None]


def _engine(model: str | None, **options) -> Engine:
    options.setdefault("kv_tokens", 4096)
    options.setdefault("debug_checks", True)
    return Engine(EngineConfig(model=model, device="cpu", dtype="float32", **options))


def score_params(k: int) -> SamplingParams:
    """What `LLM.score` and /v1/score send: the prompt plus one discarded greedy token."""
    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)


@dataclass
class Served:
    prompt_logprobs: Entries | None
    cached_tokens: int
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # each generated token's, with its alternatives
    request: Request


def serve(
    engine: Engine, requests: dict[str, tuple[list[int], SamplingParams, str | None]]
) -> dict[str, Served]:
    """Run the requests together to completion."""
    handles = {}
    for rid, (prompt, params, namespace) in requests.items():
        engine.add_request(rid, prompt, params, namespace=namespace)
        handles[rid] = engine.requests[rid]
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return {
        rid: Served(
            o[0].prompt_logprobs,
            o[-1].cached_tokens,
            [t for s in o for t in s.new_token_ids],
            [lp for s in o for lp in (s.new_logprobs or [])],
            handles[rid],
        )
        for rid, o in outs.items()
    }


def serve_one(
    engine: Engine, prompt: list[int], params: SamplingParams, namespace: str | None = None
) -> Served:
    return serve(engine, {"one": (prompt, params, namespace)})["one"]


class Cold:
    """Prompt logprobs of one cold full prefill, from an engine without a prefix cache."""

    def __init__(self, model: str | None) -> None:
        self.engine = _engine(model, enable_prefix_cache=False)
        self._memo: dict[tuple, Entries] = {}

    def __call__(self, prompt: list[int], k: int) -> Entries:
        key = (tuple(prompt), k)
        if key not in self._memo:
            served = serve_one(self.engine, prompt, score_params(k))
            assert served.cached_tokens == 0 and served.prompt_logprobs is not None
            self._memo[key] = served.prompt_logprobs
        return self._memo[key]


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def logprob_mismatches(want: Entries, got: Entries | None) -> list[str]:
    """Every position where `got` differs from `want` (a cold prefill's): token, the chosen
    logprob's bits, and the alternatives (ids and bits, exactly as many). Empty: identical."""
    if got is None or len(got) != len(want):
        return [f"{None if got is None else len(got)} entries, want {len(want)}"]
    problems = []
    for p, (w, g) in enumerate(zip(want, got, strict=True)):
        if w is None or g is None:
            if w is not g:
                problems.append(f"position {p}: {g!r}, want {w!r}")
            continue
        if g.token_id != w.token_id or _bits(g.logprob) != _bits(w.logprob):
            problems.append(f"position {p}: token {g.token_id} logprob {g.logprob!r}, want "
                            f"{w.token_id} {w.logprob!r}")  # fmt: skip
        elif [(i, _bits(v)) for i, v in g.top] != [(i, _bits(v)) for i, v in w.top]:
            problems.append(f"position {p}: {len(g.top)} alternatives {g.top[:2]}..., want "
                            f"{len(w.top)} {w.top[:2]}...")  # fmt: skip
    return problems


def check_hit(
    engine: Engine,
    cold: Cold,
    prompt: list[int],
    h: int,
    donor: str,
    k: int,
    rng: random.Random,
) -> tuple[list[str], int]:
    """On a flushed cache, serve a donor that shares exactly prompt[:h] with `prompt` (all of
    it when h == len(prompt)) and computes the logprobs of its own prompt, by scoring it or by
    generating from it; then score `prompt` with k alternatives. Returns the mismatches
    against a cold prefill and the request's cached_tokens."""
    engine.flush_cache()
    vocab = engine.decoder.spec.vocab_size
    head = prompt[:h]
    if h < len(prompt):
        head = head + [(prompt[h] + 1 + rng.randrange(vocab - 1)) % vocab]  # diverges at h
        head += [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
    if donor == "score":
        serve_one(engine, head, score_params(k))
    else:
        params = SamplingParams(max_tokens=rng.randint(1, 6), temperature=1.0, seed=h,
                                ignore_eos=True, logprobs=k, prompt_logprobs=k)  # fmt: skip
        serve_one(engine, head, params)
    got = serve_one(engine, prompt, score_params(k))
    return logprob_mismatches(cold(prompt, k), got.prompt_logprobs), got.cached_tokens


@pytest.fixture(scope="module")
def tiny_cold() -> Cold:
    return Cold("random:tiny")


@pytest.fixture(scope="module")
def default_cold() -> Cold:
    return Cold(None)


LAYOUTS = {
    "whole": {},
    "chunked": {"chunk_size": 5, "max_batch_tokens": 12, "max_running": 4},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("donor", ["score", "generate"])
def test_scored_hits_of_every_length_equal_a_cold_prefill_tiny(
    tiny_cold: Cold, donor: str, layout: str
) -> None:
    """Hits of every length h, identical prompts included: the request reuses the KV of
    h-1 positions (the logits of position h-1 give the logprob of token h) and returns the
    cold prefill's bits."""
    engine = _engine("random:tiny", **LAYOUTS[layout])
    rng = random.Random(f"{donor}-{layout}")
    n = 37
    prompt = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
    for h in range(1, n + 1):
        problems, cached = check_hit(engine, tiny_cold, prompt, h, donor, 3, rng)
        assert not problems, f"h={h}: " + "; ".join(problems[:4])
        assert cached == max(h - 1, 0), f"h={h}: cached_tokens={cached}"
    engine.check_integrity()


@pytest.mark.parametrize("donor", ["score", "generate"])
def test_scored_hits_of_every_length_equal_a_cold_prefill_default_model(
    default_cold: Cold, donor: str
) -> None:
    engine = _engine(None)
    rng = random.Random(donor)
    prompt = engine.tokenizer.encode("The lighthouse keeper counted the ships every night.")
    for h in range(1, len(prompt) + 1):
        problems, cached = check_hit(engine, default_cold, prompt, h, donor, 2, rng)
        assert not problems, f"h={h}: " + "; ".join(problems[:4])
        assert cached == max(h - 1, 0), f"h={h}: cached_tokens={cached}"
    engine.check_integrity()


def _llm(engine: Engine) -> LLM:
    llm = LLM.__new__(LLM)  # the test's engine, without loading the model again
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    return llm


def test_generate_then_score_hits_the_cache_and_equals_the_sampled_logprobs(
    default_cold: Cold,
) -> None:
    """On policy: generate at temperature 1 with a seed, then `LLM.score` prompt + output.
    The scoring reuses all but the last two positions (the last token's KV was never
    computed, and the position before it is recomputed for the last logprob), and returns
    the sampled tokens' logprobs and alternatives bit for bit, which are a cold prefill's."""
    engine = _engine(None)
    llm = _llm(engine)
    prompts = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of"]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True,
                            logprobs=2, prompt_logprobs=2)  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        full = out.prompt_token_ids + out.token_ids
        before = engine.stats()["cached_tokens_total"]
        (score,) = llm.score([full], top_logprobs=2, use_tqdm=False)
        assert engine.stats()["cached_tokens_total"] - before == len(full) - 2
        n = len(out.prompt_token_ids)
        assert score.logprobs[n:] == out.logprobs
        assert score.top_logprobs[n:] == out.top_logprobs
        assert score.top_logprobs[:n] == out.prompt_logprobs
        problems = logprob_mismatches(default_cold(full, 2), score.top_logprobs)
        assert not problems, "; ".join(problems[:4])
    engine.check_integrity()


def test_a_scored_system_prompt_serves_later_scoring_of_generations(default_cold: Cold) -> None:
    """A system prompt scored once; generations from it (no prompt logprobs) compute only
    their own tokens' logprobs, so scoring system + user + output reuses the system prompt's
    positions and computes the rest, with the sampled tokens' bits."""
    engine = _engine(None)
    system = engine.tokenizer.encode("You are a terse assistant. Answer in one line. " * 3)
    serve_one(engine, system, score_params(0))
    for i, user in enumerate(["Name a colour.", "Which river is longest?"]):
        prompt = system + engine.tokenizer.encode(user)
        gen = SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True, logprobs=0)
        out = serve_one(engine, prompt, gen)
        full = prompt + out.token_ids
        scored = serve_one(engine, full, score_params(0))
        assert scored.cached_tokens == len(system) - 1
        assert [e.logprob for e in scored.prompt_logprobs[len(prompt) :]] == [
            e.logprob for e in out.logprobs
        ]
        problems = logprob_mismatches(default_cold(full, 0), scored.prompt_logprobs)
        assert not problems, "; ".join(problems[:4])


def test_more_alternatives_than_stored_are_recomputed_never_cut(tiny_cold: Cold) -> None:
    """A position stored with fewer alternatives than asked ends the hit there; the request
    computes it with all it asked for, and the cache then holds the larger set."""
    engine = _engine("random:tiny")
    rng = random.Random(3)
    prompt = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(40)]
    steps = [  # (prompt length, alternatives asked, cached_tokens expected)
        (20, 4, 0),  # positions 1..19 now hold 4
        (40, 1, 19),  # 20..39 hold 1
        (40, 4, 19),  # 20..39 held too few: computed with 4
        (40, 4, 39),
        (40, 0, 39),
        (40, 5, 0),  # every position holds fewer than 5
        (40, 5, 39),
    ]
    for length, k, want_cached in steps:
        got = serve_one(engine, prompt[:length], score_params(k))
        problems = logprob_mismatches(tiny_cold(prompt[:length], k), got.prompt_logprobs)
        assert not problems, f"{length} tokens, k={k}: " + "; ".join(problems[:4])
        assert got.cached_tokens == want_cached, (length, k, got.cached_tokens)
        assert all(len(e.top) == k for e in got.prompt_logprobs[1:])
    engine.check_integrity()


def test_stored_logprobs_stay_in_their_namespace(tiny_cold: Cold) -> None:
    engine = _engine("random:tiny")
    rng = random.Random(4)
    prompt = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(30)]
    serve_one(engine, prompt, score_params(2), namespace="salt-a")
    for namespace, want_cached in (("salt-b", 0), (None, 0), ("salt-a", 29)):
        got = serve_one(engine, prompt, score_params(2), namespace=namespace)
        assert got.cached_tokens == want_cached, namespace
        problems = logprob_mismatches(tiny_cold(prompt, 2), got.prompt_logprobs)
        assert not problems, f"{namespace}: " + "; ".join(problems[:4])
    engine.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_scoring_and_generating_under_preemption_and_chunking_equal_cold(
    tiny_cold: Cold, seed: int
) -> None:
    """Scoring and generating requests with shared stems, mixed alternatives and namespaces,
    run together through a KV pool small enough to evict and preempt, in small chunks: every
    request's prompt logprobs are a cold prefill's, its tokens and their logprobs those of
    the request alone on an engine without a prefix cache."""
    rng = random.Random(seed)
    vocab = 512  # random:tiny
    stems = [[rng.randrange(vocab) for _ in range(rng.randint(20, 60))] for _ in range(2)]
    requests = {}
    for i in range(14):
        prompt = rng.choice(stems)[: rng.randint(1, 60)]
        prompt = prompt + [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        namespace = rng.choice([None, None, "salt"])
        k = rng.randint(0, 3)
        kind = i % 3
        if kind == 0:
            params = score_params(k)
        else:
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=1.0, seed=i,
                                    ignore_eos=True, logprobs=k,
                                    prompt_logprobs=k if kind == 1 else None)  # fmt: skip
        requests[f"r{i}"] = (prompt, params, namespace)
    largest = max(len(p) + params.max_tokens for p, params, _ in requests.values())
    engine = _engine("random:tiny", output_reserve=0.0, kv_tokens=largest + 16, max_batch_tokens=24, chunk_size=7,
                     max_running=6)  # fmt: skip
    # Twice: the second round meets a cache the first filled (and evicted from).
    for _ in range(2):
        together = serve(engine, requests)
        for rid, (prompt, params, _) in requests.items():
            got = together[rid]
            if params.prompt_logprobs is not None:
                problems = logprob_mismatches(
                    tiny_cold(prompt, params.prompt_logprobs), got.prompt_logprobs
                )
                assert not problems, f"{rid}: " + "; ".join(problems[:4])
            alone = serve_one(tiny_cold.engine, prompt, params)
            assert got.token_ids == alone.token_ids, rid
            assert got.logprobs == alone.logprobs, rid
        engine.check_integrity()
    assert engine.scheduler.num_preemptions > 0, "the KV pool forced no preemption"
    scored = [r for r, (_, p, _) in requests.items() if p.prompt_logprobs is not None]
    assert any(together[r].cached_tokens > 0 for r in scored), "no scored request hit the cache"
    assert any(together[r].request.num_preemptions for r in scored), "no scored request preempted"


# ---- negative controls ---------------------------------------------------------------------


def _one_float32_ulp_down(values: torch.Tensor, i: int) -> None:
    values[i] = torch.nextafter(values[i], torch.tensor(-math.inf))


def _node_at(engine: Engine, tokens: list[int], position: int):
    """The cached node holding `position` of `tokens`, and the position's row in it."""
    node, at = engine.radix._roots[None], 0
    while True:
        node = node.children[tokens[at]]
        if position < at + len(node.key):
            return node, position - at
        at += len(node.key)


def test_negative_control_a_perturbed_stored_logprob_fails_the_comparison(
    tiny_cold: Cold,
) -> None:
    """One stored logprob moved by one float32 ulp (a test-only edit of the tree): the
    request serves it from the cache, and the comparison of the property tests names that
    position."""
    engine = _engine("random:tiny", debug_checks=False)
    rng = random.Random(5)
    prompt = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(30)]
    serve_one(engine, prompt, score_params(0))
    node, row = _node_at(engine, prompt, 17)
    _one_float32_ulp_down(node.logprobs.logprob, row)
    got = serve_one(engine, prompt, score_params(0))
    assert got.cached_tokens == 29
    problems = logprob_mismatches(tiny_cold(prompt, 0), got.prompt_logprobs)
    assert len(problems) == 1 and problems[0].startswith("position 17:"), problems


class StoresAtTheLogitsPosition(RadixCache):
    """A realistic bug: each logprob stored at the position whose logits gave it (p - 1)
    instead of its token's position p; position 0, which takes none, drops its row."""

    def insert(self, tokens, slots, namespace=None, logprobs=None, states=None):
        if logprobs is not None and len(logprobs):
            n = len(logprobs)
            logprobs = StoredLogprobs.cat([logprobs.slice(1, n), StoredLogprobs.empty(1)])
            if n == len(tokens):
                logprobs = StoredLogprobs.cat([StoredLogprobs.empty(1), logprobs.slice(1, n)])
        return super().insert(tokens, slots, namespace, logprobs, states)


def test_negative_control_logprobs_stored_one_position_off_fail_the_property(
    tiny_cold: Cold,
) -> None:
    """The every-length property on an engine whose cache stores each logprob one position
    early: every hit (h >= 2) serves wrong logprobs, and the comparison fails on each."""
    engine = _engine("random:tiny", debug_checks=False)
    engine.radix = engine.scheduler.radix = StoresAtTheLogitsPosition(engine.pool)
    rng = random.Random(6)
    prompt = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(20)]
    failed = []
    for h in range(1, len(prompt) + 1):
        problems, cached = check_hit(engine, tiny_cold, prompt, h, "score", 0, rng)
        failed.append(bool(problems))
        assert cached == (0 if h == 1 else h - 1 if h < len(prompt) else h - 2), (h, cached)
    assert failed == [False] + [True] * (len(prompt) - 1), failed


def test_check_integrity_catches_a_stored_logprob_at_odds_with_its_token() -> None:
    """Greedy tokens are their own best alternative, so a stored logprob that differs from
    the alternative listed for its token is an inconsistency check_integrity reports."""
    engine = _engine("random:tiny")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    out = serve_one(engine, [5, 6, 7, 8], params)
    engine.check_integrity()
    tokens = [5, 6, 7, 8] + out.token_ids
    node, row = _node_at(engine, tokens, 9)  # the sixth generated token
    assert int(node.logprobs.num_top[row]) == 3 and node.key[row] == out.token_ids[5]
    _one_float32_ulp_down(node.logprobs.logprob, row)
    with pytest.raises(CacheIntegrityError, match="differs from its logprob"):
        engine.check_integrity()


def test_logprobs_from_a_start_position_reuse_a_generated_prefix(tiny_cold: Cold) -> None:
    """Scoring prompt + output from position len(prompt) on (`prompt_logprobs_start`, what
    SGLang's logprob_start_len asks for): the rollout cached the prompt's KV and its tokens'
    logprobs, so the request reuses the prompt and the output; its logprobs from the start
    equal a cold prefill's, the ones before are None. Asking for 2 alternatives the rollout
    did not compute reuses only the prompt. Control: scored from position 1 the sequence
    cannot hit, the prompt's positions have no stored logprobs."""
    engine = _engine("random:tiny")
    rng = random.Random(5)
    vocab = engine.decoder.spec.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(40)]
    rollout = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    full = prompt + serve_one(engine, prompt, rollout).token_ids
    start = len(prompt)
    for k, reused in ((0, len(full) - 2), (2, start - 1)):
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k,
                                prompt_logprobs_start=start)  # fmt: skip
        got = serve_one(engine, full, params)
        assert got.prompt_logprobs is not None and got.prompt_logprobs[:start] == [None] * start
        assert not logprob_mismatches(tiny_cold(full, k)[start:], got.prompt_logprobs[start:])
        assert got.cached_tokens == reused, (k, got.cached_tokens)
    assert serve_one(engine, full, score_params(0)).cached_tokens == 0
    engine.check_integrity()
