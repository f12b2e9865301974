"""Computes one token sequence in many different ways through the engine's real components
(KV pool, radix cache, model runner layout, decoder, ops backend) and compares every position
bitwise with one cold full prefill: logits rows and the K/V entries written to the cache.

A "way" (`Plan`) is: a prefix-cache hit of some length (another sequence sharing that prefix
was computed and cached first, so the hit may end mid-node, mid key block, mid split), a
partition of the rest into forward passes (chunk sizes 1 = decode steps), and random
batch-mates sharing each pass (other sequences at random stages of their own prefill).

Hybrid models: every sequence carries its linear-attention state; the donor's chunk-boundary
snapshots go to the radix cache with its KV, a hit resumes from the last snapshot at or below
the asked length (so `Computed.first_computed` may be below `Plan.prefix_len`), and the final
state and every boundary snapshot taken on the way are compared bitwise too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.models.forward_batch import ForwardBatch
from lockstep.ops.base import build_attention_meta


@dataclass
class Plan:
    prefix_len: int  # tokens served from the radix cache (0: cold)
    chunks: list[int]  # sizes of the forward passes over the remaining positions
    mates_per_step: list[list[int]] = field(default_factory=list)  # mate lengths per pass
    donor_step: int = 8  # the donor is computed in passes of 1..donor_step tokens

    def describe(self) -> str:
        return f"prefix={self.prefix_len} chunks={self.chunks} mates={self.mates_per_step}"


@dataclass
class Computed:
    logits: torch.Tensor  # [n - first_computed, V] for positions first_computed..n-1
    first_computed: int
    k: torch.Tensor  # [KV layers, n, Hkv, D]
    v: torch.Tensor
    state: tuple[torch.Tensor, ...] = ()  # hybrid: the final LinearState's defining tensors
    snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def reference(engine: Engine, tokens: list[int]) -> Computed:
    """One cold full prefill in a private cache (slots 0..n-1)."""
    logits, scratch = engine.decoder.cold_prefill(tokens)
    state, snaps = _state_of(scratch.linear_state)
    return Computed(logits.cpu(), 0, scratch.k.cpu(), scratch.v.cpu(), state, snaps)


def _state_of(state) -> tuple[tuple[torch.Tensor, ...], dict]:
    if state is None:
        return (), {}
    snaps = {p: (s.conv.cpu(), s.recurrent.cpu()) for p, s in state.captured.items()}
    return tuple(t.cpu().clone() for t in state.meaningful()), snaps


@dataclass
class _Seq:
    tokens: list[int]
    slots: list[int]
    done: int  # positions computed
    state: object = None  # hybrid: its LinearState


def _step(engine: Engine, parts: list[tuple[_Seq, int]]) -> list[torch.Tensor]:
    """One forward pass computing `n` more positions of each sequence; returns each part's
    logits rows (all rows of the part)."""
    tokens, positions, out_slots, rows = [], [], [], []
    counts, starts, tables = [], [], []
    need = sum(n for _, n in parts)
    if engine.pool.num_free < need:
        engine.radix.evict(need - engine.pool.num_free)
    for seq, n in parts:
        start, end = seq.done, seq.done + n
        seq.slots.extend(engine.pool.alloc(n).tolist())
        rows.append((len(tokens), len(tokens) + n))
        tokens += seq.tokens[start:end]
        positions += list(range(start, end))
        out_slots += seq.slots[start:end]
        counts.append(n)
        starts.append(start)
        tables.append(seq.slots[:end])
    meta = build_attention_meta(counts, starts, tables)
    states = None
    if engine.decoder.linear_layout is not None:
        for seq, _ in parts:
            if seq.state is None:
                seq.state = engine.decoder.new_linear_state()
        states = [seq.state for seq, _ in parts]
    batch = ForwardBatch.from_lists(tokens, positions, out_slots, meta, range(len(tokens)), states)
    batch = batch.to(engine.device)
    logits = engine.decoder.forward(batch, engine.pool).cpu()
    for seq, n in parts:
        seq.done += n
    return [logits[a:b] for a, b in rows]


def compute(engine: Engine, tokens: list[int], plan: Plan, rng: random.Random) -> Computed:
    """Compute `tokens` following `plan` through the engine's pool and radix cache. Leaves the
    pool and cache as it found them apart from cached (unlocked) entries."""
    pool, radix = engine.pool, engine.radix
    vocab = engine.decoder.spec.vocab_size
    owned: list[torch.Tensor] = []
    locked = []
    seq = _Seq(tokens, [], 0)
    if plan.prefix_len > 0:
        # A donor shares tokens[:prefix_len] and continues differently; it is computed and
        # cached, so the hit below ends inside (or at the end of) the donor's node.
        donor = _Seq(tokens[: plan.prefix_len] + [rng.randrange(vocab) for _ in range(3)], [], 0)
        while donor.done < len(donor.tokens):
            step = min(rng.randint(1, plan.donor_step), len(donor.tokens) - donor.done)
            _step(engine, [(donor, step)])
        captured = donor.state.take_captured() if donor.state is not None else None
        slots = torch.tensor(donor.slots, dtype=torch.int64)
        res = radix.insert(donor.tokens, slots, None, None, captured)
        if res.duplicate_slots.numel():
            pool.free(res.duplicate_slots)
        match = radix.match_prefix(tokens[: plan.prefix_len])
        layout = engine.decoder.linear_layout
        expected = plan.prefix_len
        if layout is not None:  # resumes at the last snapshot the donor left at or below it
            expected = max((p for p in captured or {} if p <= plan.prefix_len), default=0)
            seq.state = type(donor.state).resume(layout, match.state)
        assert match.length == expected, (match.length, expected)
        radix.lock(match.node)
        locked.append(match.node)
        seq.slots = match.slots.tolist()
        seq.done = match.length
    first = seq.done
    logits_parts = []
    mates: list[_Seq] = []
    chunks = list(plan.chunks)
    if first < plan.prefix_len:  # a hybrid hit resumed below the asked length
        chunks[0] += plan.prefix_len - first
    for i, n in enumerate(chunks):
        parts = [(seq, n)]
        for length in plan.mates_per_step[i] if i < len(plan.mates_per_step) else []:
            mate = _Seq([rng.randrange(vocab) for _ in range(length)], [], 0)
            mate_n = rng.randint(1, length)
            mates.append(mate)
            parts.append((mate, mate_n))
        rng.shuffle(parts)  # the sequence's row offset in the pass varies too
        out = _step(engine, parts)
        logits_parts.append(out[[p[0] for p in parts].index(seq)])
    n_total = len(tokens)
    assert seq.done == n_total, (seq.done, n_total)
    slot_ids = torch.tensor(seq.slots, dtype=torch.int64)
    k, v = engine.decoder.read_kv(pool, slot_ids)  # every KV head, whatever the tp degree
    # Give everything back: the sequence's own slots and the mates' slots are freed.
    own = seq.slots[first:]
    owned.append(torch.tensor(own, dtype=torch.int64))
    owned += [torch.tensor(m.slots, dtype=torch.int64) for m in mates]
    for slots in owned:
        if slots.numel():
            pool.free(slots)
    for node in locked:
        radix.unlock(node)
    state, snaps = _state_of(seq.state)
    return Computed(torch.cat(logits_parts), first, k.cpu(), v.cpu(), state, snaps)


def random_plan(rng: random.Random, n: int, max_mates: int, allow_prefix: bool = True) -> Plan:
    prefix = rng.randint(0, n - 1) if allow_prefix and rng.random() < 0.6 else 0
    rest = n - prefix
    chunks = []
    style = rng.random()
    while rest > 0:
        if style < 0.25:
            c = 1  # decode, one token at a time
        elif style < 0.5:
            c = rest  # one prefill of everything left
        else:
            c = rng.randint(1, rest)
        chunks.append(c)
        rest -= c
    mates = [[rng.randint(1, 24) for _ in range(rng.randint(0, max_mates))] for _ in chunks]
    return Plan(prefix, chunks, mates)


def mismatches(ref: Computed, got: Computed) -> list[str]:
    """Describe every way `got` differs from `ref` bitwise (empty: identical)."""
    problems = []
    ref_rows = ref.logits[got.first_computed :]
    if not torch.equal(ref_rows, got.logits):
        bad = (ref_rows != got.logits).any(dim=1).nonzero().flatten()
        problems.append(
            f"logits differ at positions {(bad + got.first_computed).tolist()[:8]}, "
            f"max |delta| {float((ref_rows - got.logits).abs().max()):.3g}"
        )
    for name, a, b in (("K", ref.k, got.k), ("V", ref.v, got.v)):
        if not torch.equal(a, b):
            bad = (a != b).flatten(2).any(dim=2).any(dim=0).nonzero().flatten()
            problems.append(f"{name} cache differs at positions {bad.tolist()[:8]}")
    names = ("conv window", "boundary state", "open keys", "open decays or gates",
             "open values", "open betas")  # fmt: skip
    for name, a, b in zip(names[: len(ref.state)], ref.state, got.state, strict=True):
        if not torch.equal(a, b):
            problems.append(f"final linear state: {name} differs")
    for position, (conv, recurrent) in got.snapshots.items():
        theirs = ref.snapshots.get(position)
        if theirs is None or not (
            torch.equal(conv, theirs[0]) and torch.equal(recurrent, theirs[1])
        ):
            problems.append(f"linear-state snapshot at position {position} differs")
    return problems


Requests = dict[str, tuple[list[int], SamplingParams]]


def generate(engine: Engine, batch: Requests) -> dict[str, tuple[list[int], list[float]]]:
    """Queue every request of `batch` at once and step the engine until all finish: each
    request's generated tokens and their logprobs."""
    for rid, (prompt, params) in batch.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in batch}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_token_logprobs)
    return got


def differ_alone(engine: Engine, requests: Requests) -> list[str]:
    """The requests whose tokens or logprobs scheduled together differ from the same request
    run alone on a cold cache (flushed before each); the pool holds nothing afterwards."""
    together = generate(engine, requests)
    differing = []
    for rid, request in requests.items():
        engine.flush_cache()
        if generate(engine, {rid: request})[rid] != together[rid]:
            differing.append(rid)
    assert engine.stats()["kv_in_use"] == 0
    return differing


def check_prefix_hits_of_every_length(engine: Engine, vocab: int, chunk: int) -> None:
    """Hybrid models: hits of every length 1..3C, each followed by an uncached tail of 1..40
    tokens (the lengths that break other engines' hybrid caches), the tail in one pass beside
    a mate; every position equal to a cold prefill."""
    rng = random.Random(11)
    stem = [rng.randrange(vocab) for _ in range(3 * chunk)]
    for prefix in range(1, 3 * chunk + 1):
        tail = 1 + (prefix - 1) % 40
        tokens = stem[:prefix] + [rng.randrange(vocab) for _ in range(tail)]
        plan = Plan(prefix, [tail], [[rng.randint(1, 9)]], donor_step=chunk)
        problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        assert not problems, f"prefix={prefix} tail={tail}: " + "; ".join(problems)
        engine.flush_cache()
    engine.check_integrity()


def check_every_chunk_size(engine: Engine, vocab: int, chunk: int) -> None:
    """A prompt of C + 37 tokens prefilled in chunks of every size 1..n: equal to one prefill."""
    rng = random.Random(5)
    n = chunk + 37
    tokens = [rng.randrange(vocab) for _ in range(n)]
    ref = reference(engine, tokens)
    for size in range(1, n + 1):
        chunks = [size] * (n // size) + ([n % size] if n % size else [])
        problems = mismatches(ref, compute(engine, tokens, Plan(0, chunks), rng))
        assert not problems, f"chunk size {size}: " + "; ".join(problems)
    engine.check_integrity()


def schedule_failures(
    engine: Engine,
    cases: int,
    lengths: tuple[int, int] = (1, 600),
    max_mates: int = 4,
    wide_mates: bool = False,
) -> list[str]:
    """Random schedules (`random_plan`, seeds 0..cases-1, sequences of `lengths` tokens)
    whose positions differ from a cold prefill: each failing case's description.
    `wide_mates`: sequences of 16 to 200 tokens beside 8- to 64-token batch-mates in every
    pass and no prefix hit (the reference-mode controls: wide mates change their GEMMs' shapes)."""
    failures = []
    for seed in range(cases):
        rng = random.Random(seed)
        n = rng.randint(16, 200) if wide_mates else rng.randint(*lengths)
        tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=max_mates, allow_prefix=not wide_mates)
        if wide_mates:
            plan.mates_per_step = [[rng.randint(8, 64) for _ in range(4)] for _ in plan.chunks]
        problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        if problems:
            failures.append(f"seed={seed} n={n} {plan.describe()}: {problems[0]}")
        engine.check_integrity()
    return failures


def generation_scoring_mismatches(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> list[int]:
    """Generate from `prompts` side by side through `engine`, then score each prompt + its
    generated tokens in one prefill: the prompts whose generated logprobs differ from the
    scored ones (decode vs rescoring, which on-policy RL needs equal)."""
    from lockstep.engine.llm import LLM

    llm = LLM.__new__(LLM)  # around `engine`, without loading the model again
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
    return [
        i
        for i, (out, score) in enumerate(zip(outs, scores, strict=True))
        if score.logprobs[len(out.prompt_token_ids) :] != out.logprobs
    ]
