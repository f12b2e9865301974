"""Exact speculative decoding (docs/speculative.md): with speculation on, every request's tokens,
logprobs (top alternatives included), finish reason and cached KV entries are those of plain
decode, bit for bit, greedy and seeded, beside batch-mates, from the prefix cache and through
preemption; rejected drafts never reach the radix cache.

Drafters: prompt lookup (the n-gram drafter the engine ships), and two controls built from the
reference outputs: one that always proposes the true continuation (every draft is kept, so
stop tokens and max_tokens must cut accepted runs exactly) and one that always proposes a
wrong token (every draft is rejected). Negative control: reference mode, whose CPU matmuls are not
invariant to the number of rows, gives other logprobs with speculation than without.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest
import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ConfigError

Requests = dict[str, tuple[list[int], SamplingParams]]


def _engine(model: str | None, **options) -> Engine:
    options.setdefault("kv_tokens", 4096)
    options.setdefault("debug_checks", True)
    return Engine(EngineConfig(model=model, device="cpu", dtype="float32", **options))


def _speculating(model: str | None, **options) -> Engine:
    options = {"speculative": "ngram", "num_draft_tokens": 4, "prompt_lookup_min": 1} | options
    return _engine(model, **options)


def _run(engine: Engine, requests: Requests) -> dict[str, tuple]:
    """Each request's tokens, per-token logprobs (with top alternatives when asked), text,
    finish reason and cached prompt tokens."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return {
        rid: (
            [t for o in got for t in o.new_token_ids],
            [lp for o in got for lp in (o.new_logprobs or o.new_token_logprobs)],
            "".join(o.new_text for o in got),
            got[-1].finish_reason,
            got[-1].cached_tokens,
        )
        for rid, got in outs.items()
    }


def _alone(engine: Engine, requests: Requests) -> dict[str, tuple]:
    """Each request run alone on a cold cache (the contract's reference)."""
    results = {}
    for rid, request in requests.items():
        engine.flush_cache()
        results[rid] = _run(engine, {rid: request})[rid]
    return results


def _copy_prompts(rng: random.Random, vocab: int, count: int) -> list[list[int]]:
    """Prompts that invite copying (a stem repeated, so prompt lookup finds continuations)
    and share prefixes (so later requests hit the radix cache)."""
    stems = [[rng.randrange(min(vocab, 64)) for _ in range(rng.randint(6, 16))] for _ in range(4)]
    prompts = []
    for _ in range(count):
        stem = rng.choice(stems)
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        prompts.append(stem * rng.randint(1, 3) + stem[: rng.randint(1, len(stem))] + tail)
    return prompts


def _assert_pool_free(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.stats()["kv_in_use"] == 0
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_slots, engine.stats()


def _cached_sequences(engine: Engine) -> list[tuple[int, ...]]:
    """Every root-to-leaf token sequence the radix cache holds."""
    sequences = []
    for node in engine.radix._nodes():
        if node.children or node.parent is None:
            continue
        keys, at = [], node
        while at.parent is not None:
            keys.append(at.key)
            at = at.parent
        sequences.append(tuple(t for key in reversed(keys) for t in key))
    return sequences


def _not_kept(
    cached: Sequence[tuple[int, ...]], finals: Sequence[Sequence[int]]
) -> list[tuple[int, ...]]:
    """Cached sequences that are not a prefix of any request's prompt and output: each holds
    a token no request kept."""
    return [seq for seq in cached if not any(tuple(full[: len(seq)]) == seq for full in finals)]


class _ReferenceDrafter:
    """A control drafter that knows the reference outputs: it proposes the true continuation
    (`wrong` False: every draft is kept) or, at every position, a token other than the true one
    (`wrong` True: every draft is rejected)."""

    def __init__(self, sequences: Sequence[Sequence[int]], vocab: int, wrong: bool) -> None:
        self.sequences = [list(s) for s in sequences]
        self.vocab = vocab
        self.wrong = wrong

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        n = len(tokens)
        for full in self.sequences:
            if len(full) > n and full[:n] == list(tokens):
                true = full[n : n + limit]
                return [(t + 1) % self.vocab for t in true] if self.wrong else true
        return []


# The default model runs fewer requests (each is compared with a run of its own); its pool
# is smaller in proportion, so both still evict and preempt.
@pytest.mark.parametrize(
    ("model", "count", "gen", "kv_tokens"), [("random:tiny", 32, 16, 600), (None, 6, 8, 120)]
)
def test_ngram_speculation_batched_with_preemption_equals_plain_alone(
    model, count, gen, kv_tokens
) -> None:
    rng = random.Random(0)
    spec = _speculating(
        model, kv_tokens=kv_tokens, max_batch_tokens=256, chunk_size=48, output_reserve=0.0
    )
    vocab = spec.decoder.spec.vocab_size
    prompts = _copy_prompts(rng, vocab, count)
    requests = {
        f"r{i}": (p, SamplingParams(max_tokens=gen, temperature=rng.choice([0.0, 1.0]), seed=i,
                                    ignore_eos=True, logprobs=2))
        for i, p in enumerate(prompts)
    }  # fmt: skip
    together = _run(spec, requests)
    stats = spec.stats()
    assert stats["num_preemptions"] > 0, "the KV budget did not force a preemption"
    assert any(r[4] > 0 for r in together.values()), "no prefix was reused"
    assert 0 < stats["spec_accepted_tokens_total"] < stats["spec_drafted_tokens_total"], stats
    finals = [requests[rid][0] + together[rid][0] for rid in requests]
    cached = _cached_sequences(spec)
    assert cached, "nothing cached: the check below would prove nothing"
    assert not _not_kept(cached, finals), "the radix cache holds a rejected draft"
    # The check can fail: a cached sequence ending in a token no request kept is reported.
    bogus = (*finals[0][:-1], (finals[0][-1] + 1) % vocab)
    assert _not_kept([*cached, bogus], finals) == [bogus]
    _assert_pool_free(spec)

    plain = _engine(model)
    alone = _alone(plain, requests)
    for rid in requests:
        assert together[rid][:4] == alone[rid][:4], f"{rid} differs with speculation"


def test_cached_kv_of_verified_tokens_equals_plain_decode() -> None:
    """The KV entries a verify step writes for kept tokens, once in the radix cache, are the
    bits plain decode caches for the same positions."""
    rng = random.Random(3)
    spec, plain = _speculating("random:tiny"), _engine("random:tiny")
    vocab = spec.decoder.spec.vocab_size
    requests = {
        f"r{i}": (p, SamplingParams(max_tokens=24, temperature=t, seed=i, ignore_eos=True))
        for i, (p, t) in enumerate(zip(_copy_prompts(rng, vocab, 6), [0.0, 1.0] * 3, strict=True))
    }
    got, want = _run(spec, requests), _run(plain, requests)
    assert spec.stats()["spec_accepted_tokens_total"] > 0
    for rid, (prompt, _) in requests.items():
        full = prompt + got[rid][0]
        ours, theirs = spec.radix.match_prefix(full), plain.radix.match_prefix(full)
        # Everything computed is cached: the prompt and every output but the last token.
        assert ours.length == theirs.length == len(full) - 1, rid
        k1, v1 = spec.decoder.read_kv(spec.pool, ours.slots)
        k2, v2 = plain.decoder.read_kv(plain.pool, theirs.slots)
        assert torch.equal(k1, k2) and torch.equal(v1, v2), rid
    assert got == want


@pytest.mark.parametrize("wrong", [False, True], ids=["always-right", "always-wrong"])
def test_control_drafters_give_the_plain_outputs(wrong: bool) -> None:
    """Every draft kept, or every draft rejected: the same outputs. The always-right drafter
    proposes past stop tokens and max_tokens, which must cut its accepted runs exactly where
    plain decode stops."""
    rng = random.Random(5)
    plain = _engine("random:tiny")
    vocab = plain.decoder.spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 20))] for _ in range(10)]
    free = {
        f"r{i}": (p, SamplingParams(max_tokens=20, temperature=i % 2, seed=i, ignore_eos=True))
        for i, p in enumerate(prompts)
    }
    free_run = _run(plain, free)
    drafter = _ReferenceDrafter([free[r][0] + free_run[r][0] for r in free], vocab, wrong)
    requests: Requests = {}
    for i, (rid, (prompt, params)) in enumerate(free.items()):
        tokens = free_run[rid][0]
        if i % 3 == 0:  # a stop token mid-run
            params = dataclasses.replace(params, stop_token_ids=[tokens[5 + i % 4]])
        elif i % 3 == 1:  # max_tokens inside what the drafter proposes
            params = dataclasses.replace(params, max_tokens=1 + i % 7, logprobs=3)
        requests[rid] = (prompt, params)
    want = _run(plain, requests)
    assert any(r[3] == "stop" for r in want.values())

    spec = _speculating("random:tiny", max_batch_tokens=64, chunk_size=16)
    spec.speculator.drafter = drafter
    got = _run(spec, requests)
    counters = spec.speculator.counters
    assert counters.drafted > 0
    if wrong:
        assert counters.accepted == 0
    else:
        # Drafts are lost only where a stop or max_tokens ends a run: once per request.
        assert 0 < counters.drafted - counters.accepted <= 4 * len(requests), counters
        assert counters.verify_chunks < sum(len(r[0]) for r in got.values()) - len(got)
    finals = [requests[r][0] + got[r][0] for r in requests]
    cached = _cached_sequences(spec)
    assert cached and not _not_kept(cached, finals)
    for rid in requests:
        assert got[rid][:4] == want[rid][:4], rid
    _assert_pool_free(spec)


def test_real_text_copy_with_stop_string_and_radix_hit() -> None:
    """The embedded model editing a paragraph: prompt lookup keeps most drafts; a stop string
    taken from the plain run's text ends the speculating run at the same token; the second
    request hits the radix cache the first one filled."""
    paragraph = (
        "The river runs through the old town, past the market square and under the stone "
        "bridge, where fishermen sell their catch every morning before the sun is high."
    )
    prompt = f"Repeat this text exactly.\n\nText: {paragraph}\n\nCopy: The river runs"
    plain, spec = _engine(None), _speculating(None, prompt_lookup_min=2)
    ids = plain.tokenizer.encode(prompt)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    want = {"a": _run(plain, {"a": (ids, greedy)})["a"]}
    stop = want["a"][2][len(want["a"][2]) // 2 :][:6]
    requests: Requests = {
        "a": (ids, greedy),
        "b": (ids, dataclasses.replace(greedy, stop=[stop], seed=7, temperature=0.7)),
    }
    want["b"] = _run(plain, {"b": requests["b"]})["b"]
    assert want["b"][3] == "stop"
    got = {rid: _run(spec, {rid: r})[rid] for rid, r in requests.items()}
    assert got["b"][4] > 0, "the second request did not hit the radix cache"
    for rid in requests:
        assert got[rid][:4] == want[rid][:4], rid
    counters = spec.speculator.counters
    assert counters.acceptance_rate > 0.5, counters


def test_negative_control_reference_mode_speculation_differs() -> None:
    """Reference mode's CPU matmuls give a row other bits when the step has other rows: a verify
    chunk of 5 rows does not reproduce one-row decode there, so the comparison above fails."""
    rng = random.Random(1)
    plain = _engine(None, mode="reference")
    vocab = plain.decoder.spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    requests = {
        f"r{i}": (p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(prompts)
    }
    want = _run(plain, requests)
    spec = _speculating(None, mode="reference")
    spec.speculator.drafter = _ReferenceDrafter(
        [requests[r][0] + want[r][0] for r in requests], vocab, wrong=False
    )
    got = _run(spec, requests)
    assert spec.speculator.counters.accepted > 0
    assert any(got[r][1] != want[r][1] for r in requests), "reference mode gave the same bits"


def test_speculation_is_refused_where_it_cannot_be_exact() -> None:
    with pytest.raises(ConfigError, match="speculative='eagle' is invalid"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ConfigError, match="overlap_decode=True is invalid"):
        EngineConfig(speculative="ngram", overlap_decode=True)
    with pytest.raises(ConfigError, match="prompt_lookup_min=5"):
        EngineConfig(speculative="ngram", prompt_lookup_min=5, prompt_lookup_max=4)
    with pytest.raises(ConfigError, match="num_draft_tokens=0"):
        EngineConfig(speculative="ngram", num_draft_tokens=0)
    assert not EngineConfig(speculative="ngram", device="cuda").use_overlap_decode


@pytest.mark.parametrize("drafter", ["ngram", "always-right"])
@pytest.mark.parametrize(("seed", "kv_tokens"), [(0, 4096), (2, 120)])
def test_mixed_workload_with_arrivals_aborts_and_processing(
    drafter: str, seed: int, kv_tokens: int
) -> None:
    """The overlapped-decode suite's workload (arrivals mid-run, aborts, stop tokens and
    strings, top and prompt logprobs, penalties and grammars, a tight pool): requests whose
    logits are processed decode one token at a time beside speculating ones, and every output
    is the plain loop's."""
    from tests.contract.test_overlap_decode import _drive, _workload, assert_same_outputs

    options = {"kv_tokens": kv_tokens, "max_running": 6, "output_reserve": 0.0}
    plain = _engine("random:tiny", **options)
    work = _workload(seed, plain.decoder.spec.vocab_size)
    want = _drive(plain, work)
    spec = _speculating("random:tiny", **options)
    if drafter == "always-right":
        finals = [prompt + want[rid][0] for _, rid, prompt, _, _ in work]
        spec.speculator.drafter = _ReferenceDrafter(finals, plain.decoder.spec.vocab_size, False)
    assert_same_outputs(_drive(spec, work), want, work)
    assert spec.speculator.counters.verify_chunks > 0
    if drafter == "always-right":
        assert spec.speculator.counters.accepted > 0


def test_tensor_parallel_speculation_equals_plain() -> None:
    """At tp=2 (gloo worker processes) a verify chunk is one more batch the ranks compute:
    the outputs of the plain tp=2 engine."""
    from lockstep import LLM

    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    options = {"device": "cpu", "kv_tokens": 512, "tp": 2, "tp_reduction": "chunked"}
    plain = LLM("random:tiny", **options)
    try:
        want = [(o.token_ids, o.logprobs) for o in plain.generate(prompts, params, use_tqdm=False)]
    finally:
        plain.close()
    spec = LLM("random:tiny", **options, speculative="ngram", prompt_lookup_min=1)
    try:
        got = [(o.token_ids, o.logprobs) for o in spec.generate(prompts, params, use_tqdm=False)]
        assert spec.engine.stats()["spec_accepted_tokens_total"] > 0
    finally:
        spec.close()
    assert got == want


@pytest.mark.parametrize("draft", ["random:tiny", "random:tiny-qwen3"])
def test_draft_model_speculation_equals_plain(draft: str) -> None:
    """A draft model of the same tokenizer proposes greedily from its own engine. The target's
    own weights as the draft keep every greedy draft (the same bits give the same argmax);
    another model keeps fewer; the outputs are the plain engine's either way, beside
    batch-mates and through preemption."""
    rng = random.Random(4)
    options = {"kv_tokens": 120, "max_batch_tokens": 128, "chunk_size": 32, "output_reserve": 0.0}
    plain = _engine("random:tiny", **options)
    vocab = plain.decoder.spec.vocab_size
    requests = {
        f"r{i}": ([rng.randrange(vocab) for _ in range(rng.randint(4, 30))],
                  SamplingParams(max_tokens=20, temperature=0.0 if i < 6 else 1.0, seed=i,
                                 ignore_eos=True, logprobs=1))
        for i in range(10)
    }  # fmt: skip
    want = _run(plain, requests)
    spec = _engine("random:tiny", speculative="draft", draft_model=draft, **options)
    got = _run(spec, requests)
    assert spec.scheduler.num_preemptions > 0
    for rid in requests:
        assert got[rid][:4] == want[rid][:4], rid
    assert spec.speculator.counters.accepted > 0
    _assert_pool_free(spec)
    if draft == "random:tiny":
        # Greedy requests alone: the draft's argmax is the target's at every position (drafts
        # never run past max_tokens), so every draft is kept.
        greedy = {rid: r for rid, r in requests.items() if r[1].temperature == 0.0}
        again = _engine("random:tiny", speculative="draft", draft_model=draft, **options)
        alone = _run(again, greedy)
        assert all(alone[rid][:4] == want[rid][:4] for rid in greedy)
        counters = again.speculator.counters
        assert counters.drafted > 0 and counters.accepted == counters.drafted, counters


def test_draft_model_of_another_tokenizer_is_refused() -> None:
    with pytest.raises(ConfigError, match="draft_model='random:smollm2-135m' is invalid"):
        _engine("random:tiny", speculative="draft", draft_model="random:smollm2-135m")
    with pytest.raises(ConfigError, match="expected speculative='draft' with a draft_model"):
        EngineConfig(speculative="draft")
    with pytest.raises(ConfigError, match="a draft_model only with speculative='draft'"):
        EngineConfig(speculative="ngram", draft_model="random:tiny")


def test_runs_that_reach_the_context_limit_stop_where_plain_decode_does() -> None:
    """Prompt and max_tokens fill the whole context: the always-right drafter proposes to the
    end, and no verify chunk computes a position plain decode would not (the last token's
    position, P + max_tokens - 1, is never computed: below max_model_len, and within the KV
    slots add_request counted)."""
    rng = random.Random(6)
    plain = _engine("random:tiny", max_model_len=64)
    prompts = [[rng.randrange(512) for _ in range(64 - gen)] for gen in (1, 2, 5, 24)]
    requests = {
        f"r{i}": (p, SamplingParams(max_tokens=64 - len(p), temperature=0.0, ignore_eos=True))
        for i, p in enumerate(prompts)
    }
    want = _run(plain, requests)
    spec = _speculating("random:tiny", max_model_len=64)
    spec.speculator.drafter = _ReferenceDrafter(
        [requests[r][0] + want[r][0] for r in requests], 512, wrong=False
    )
    widest = []
    real_launch = spec.runner.launch

    def launch(plan, *args, **kwargs):
        for c in plan:
            assert c.end <= len(c.request.prompt_ids) + c.request.params.max_tokens - 1, c
        widest.append(max(len(c.draft) for c in plan))
        return real_launch(plan, *args, **kwargs)

    spec.runner.launch = launch
    got = _run(spec, requests)
    assert max(widest) == 4
    for rid in requests:
        assert got[rid][:4] == want[rid][:4] and len(got[rid][0]) == 64 - len(requests[rid][0])
