"""The scenarios of `lockstep check`, one async function each.

Every scenario computes some sequences one way (the reference: alone, cold, or generated) and
again another way the contract says must not matter (in a burst of random batch-mates, from
the prefix cache, teacher-forced, after a restart), and compares every position bitwise.
Each takes a `ScenarioContext` and fills in a `ScenarioResult`; the runner counts requests,
times the scenario and turns a `ServerFault` into a FAIL.

Prompts are token ids where exact lengths matter (prefixes, cache hits, the context limit)
and text elsewhere, so both prompt paths of a server get exercised. Random token ids come from
a low range that every common vocabulary has as ordinary tokens (special tokens sit at the
ends of the vocabularies of Llama, Qwen and SmolLM alike).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lockstep.check.client import (
    CheckClient,
    Completion,
    Prompt,
    RequestRefused,
    Scored,
    ServerFault,
)
from lockstep.check.compare import FAIL, PairDiff, ScenarioResult, compare_runs

T = TypeVar("T")

TOKEN_ID_RANGE = (300, 8000)
PROBE_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
)
FINGERPRINT_FORMAT = 1
# Fixed, so that fingerprints saved by one run compare with a later run whatever its --seed.
FINGERPRINT_SEED = 20240901


@dataclass(frozen=True)
class ScenarioSettings:
    """The user's knobs that scenarios read (see `lockstep check --help`)."""

    concurrency: int = 8
    max_tokens: int = 16
    atol: float = 0.0
    seed: int = 0
    max_model_len: int | None = None
    save: Path | None = None
    against: Path | None = None
    # The speculative scenario (`lockstep check --serve` only): where the first server's
    # outputs go, and where the second server, started with speculation, reads them.
    speculative_save: Path | None = None
    speculative_against: Path | None = None


@dataclass
class ScenarioContext:
    """What a scenario may use: the client, the model name, the settings, a seeded RNG, its
    time deadline (time.monotonic) and what the server said about itself."""

    client: CheckClient
    model: str
    settings: ScenarioSettings
    rng: random.Random
    deadline: float
    engine_info: dict[str, Any] | None = None
    model_card: dict[str, Any] | None = None
    set_total: Callable[[int], None] = lambda n: None
    advance: Callable[[], None] = lambda: None
    _flush_path: str | None = field(default=None, init=False)
    _flush_known: bool = field(default=False, init=False)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def units(self, planned: int, result: ScenarioResult, what: str) -> Iterator[int]:
        """Yield 0..planned-1, stopping early (and saying so) when the next unit would likely
        overrun the deadline. The first unit always runs, so every scenario compares
        something."""
        self.set_total(planned)
        last = 0.0
        for i in range(planned):
            if i > 0 and self.time_left() < last:
                result.truncated = True
                result.note(f"time budget ran out: ran {i} of {planned} {what}")
                return
            start = time.monotonic()
            yield i
            last = time.monotonic() - start
            self.advance()

    async def greedy(self, prompt: Prompt, max_tokens: int | None = None) -> Completion:
        return await self.client.completion(
            self.model, prompt, max_tokens=max_tokens or self.settings.max_tokens
        )

    async def flush(self, result: ScenarioResult) -> bool:
        """Empty the server's prefix cache; notes once per scenario when the server cannot."""
        if not self._flush_known:
            self._flush_path = await self.client.flush_cache()
            self._flush_known = True
        elif self._flush_path is not None:
            await self.client.flush_cache()
        if self._flush_path is None:
            result.note(
                "server has no /flush_cache or /reset_prefix_cache: runs meant cold may hit"
            )
        return self._flush_path is not None

    def random_ids(self, n: int, rng: random.Random | None = None) -> list[int]:
        r = rng or self.rng
        return [r.randrange(*TOKEN_ID_RANGE) for _ in range(n)]

    async def random_request(self) -> Completion:
        """A batch-mate: random length, random output length, greedy or seeded sampling."""
        temperature = self.rng.choice((0.0, 0.7, 1.0))
        return await self.client.completion(
            self.model,
            self.random_ids(self.rng.randint(4, 200)),
            max_tokens=self.rng.randint(1, 2 * self.settings.max_tokens),
            temperature=temperature,
            seed=self.rng.randrange(2**31) if temperature > 0 else None,
        )

    def compare(self, result: ScenarioResult, ref: Completion, run: Completion) -> PairDiff:
        diff = compare_runs(ref.keys, ref.logprobs, run.keys, run.logprobs, self.settings.atol)
        result.add_pair(diff)
        return diff


async def gather_all(aws: list[Awaitable[T]]) -> list[T]:
    """Like asyncio.gather, but lets every request finish before raising the first error, so
    that no request is left running against the server behind the harness's back."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


async def _after(delay_s: float, aw: Awaitable[T]) -> T:
    await asyncio.sleep(delay_s)
    return await aw


def _probe_prompts(ctx: ScenarioContext) -> list[Prompt]:
    """Two probes: text, and token ids of a length that is not a power of two."""
    return [PROBE_TEXTS[0], ctx.random_ids(45)]


async def _alone_vs_bursts(
    ctx: ScenarioContext, result: ScenarioResult, temperature: float, planned: int
) -> None:
    """Each probe alone (sequential: nothing else in flight), then inside bursts of
    `concurrency - 1` random concurrent requests, at a random place in the burst.

    Probes alternate, and the cache is flushed before bursts 2, 6, ...: each probe comes
    from the cache (hit, hit), then cold (cold, cold), and so on, so that the probe's prefill
    also runs beside the batch-mates and not only its decode. Within a burst, starts are staggered by up to
    20 ms (a few decode steps on a GPU) so that prefills land beside other requests' decodes."""
    probes = _probe_prompts(ctx)
    seeds = [ctx.rng.randrange(2**31) if temperature > 0 else None for _ in probes]

    async def probe(i: int) -> Completion:
        return await ctx.client.completion(
            ctx.model,
            probes[i],
            max_tokens=ctx.settings.max_tokens,
            temperature=temperature,
            seed=seeds[i],
        )

    refs = [await probe(i) for i in range(len(probes))]
    mates = max(1, ctx.settings.concurrency - 1)
    for unit in ctx.units(planned, result, "bursts"):
        i = unit % len(probes)
        if unit % 4 == 2:
            await ctx.flush(result)
        where = ctx.rng.randint(0, mates)
        aws: list[Awaitable[Completion]] = [ctx.random_request() for _ in range(mates)]
        aws.insert(where, probe(i))
        outs = await gather_all([_after(ctx.rng.uniform(0, 0.02), aw) for aw in aws])
        ctx.compare(result, refs[i], outs[where])
        for out in outs:
            result.add_cached(out.cached_tokens)
    result.note(f"burst size {mates + 1}; probes: {len(probes)} (text and token ids)")


async def scenario_batch(ctx: ScenarioContext, result: ScenarioResult) -> None:
    """Greedy probes alone versus inside bursts of concurrent random requests."""
    await _alone_vs_bursts(ctx, result, temperature=0.0, planned=6)


async def scenario_sampling(ctx: ScenarioContext, result: ScenarioResult) -> None:
    """Seeded temperature-1 sampling alone versus inside bursts: the draws must not depend on
    the batch-mates."""
    await _alone_vs_bursts(ctx, result, temperature=1.0, planned=4)


async def scenario_prefix(ctx: ScenarioContext, result: ScenarioResult) -> None:
    """Prompts sharing prefixes of many lengths, sent in random orders (sequential and
    concurrent rounds, cache flushed before each where possible), compared with the first
    round."""
    lengths = [1, 2, 3, 5, 8, 13, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 191]
    base = ctx.random_ids(max(lengths))
    prompts = [base[:k] + ctx.random_ids(ctx.rng.randint(1, 4)) for k in lengths]
    prompts.append(base)
    max_tokens = max(1, ctx.settings.max_tokens // 2)

    async def send_round(concurrent: bool) -> list[Completion]:
        """Flush, then all prompts in a random order; outputs in prompt order."""
        await ctx.flush(result)
        order = list(range(len(prompts)))
        ctx.rng.shuffle(order)
        if concurrent:
            outs = await gather_all([ctx.greedy(prompts[j], max_tokens) for j in order])
        else:
            outs = [await ctx.greedy(prompts[j], max_tokens) for j in order]
        by_prompt: dict[int, Completion] = {}
        for j, out in zip(order, outs, strict=True):
            by_prompt[j] = out
            result.add_cached(out.cached_tokens)
        return [by_prompt[j] for j in range(len(prompts))]

    refs = await send_round(concurrent=False)
    for rnd in ctx.units(4, result, "rounds"):
        # Concurrent first: prompts sharing prefixes arriving together is the harder case.
        for ref, out in zip(refs, await send_round(concurrent=rnd % 2 == 0), strict=True):
            ctx.compare(result, ref, out)
    result.note(
        f"{len(prompts)} prompts sharing prefixes of {len(lengths)} lengths up to {len(base)}"
    )


async def scenario_radix(ctx: ScenarioContext, result: ScenarioResult) -> None:
    """Cold prefill after a cache flush versus full and partial prefix-cache hits.

    A: flush, cold P.   B: P again (full hit) == A.   C: P + tail (partial hit).
    D: flush, cold P + tail == C.   Hits must report cached_tokens > 0, or nothing was proven.
    Without a flush endpoint only A/B run, on fresh random prompts."""
    fresh = random.Random(ctx.rng.randrange(2**63) ^ time.monotonic_ns())
    hit_cached: list[int | None] = []
    for _ in ctx.units(3, result, "prompt families"):
        can_flush = await ctx.flush(result)
        # Without a flush, only never-seen prompts are cold: draw them from a fresh RNG.
        prompt = ctx.random_ids(ctx.rng.randint(40, 160), None if can_flush else fresh)
        cold = await ctx.greedy(prompt)
        hit = await ctx.greedy(prompt)
        ctx.compare(result, cold, hit)
        hit_cached.append(hit.cached_tokens)
        for out in (cold, hit):
            result.add_cached(out.cached_tokens)
        if cold.cached_tokens and can_flush:
            result.note(f"a cold run after the flush reported {cold.cached_tokens} cached tokens")
        if not can_flush:
            continue
        extended = prompt + ctx.random_ids(ctx.rng.randint(1, 24))
        partial = await ctx.greedy(extended)
        await ctx.flush(result)
        cold_ext = await ctx.greedy(extended)
        ctx.compare(result, cold_ext, partial)
        hit_cached.append(partial.cached_tokens)
        result.add_cached(partial.cached_tokens)
        result.add_cached(cold_ext.cached_tokens)
    zeros, absent = hit_cached.count(0), hit_cached.count(None)
    if zeros or absent:
        what = " and ".join(
            f"{n} {word}" for n, word in ((zeros, "reported 0"), (absent, "left it out")) if n
        )
        result.fail(
            f"cache not exercised: proves nothing (usage.prompt_tokens_details.cached_tokens"
            f" on {len(hit_cached)} cache hits: {what})"
        )


async def scenario_score(ctx: ScenarioContext, result: ScenarioResult) -> None:
    """Generation logprobs versus teacher-forced scoring of prompt + completion, through
    POST /v1/score or else echo=true on /v1/completions."""
    prompts: list[Prompt] = [ctx.random_ids(n) for n in (7, 40, 113)] + [PROBE_TEXTS[2]]
    method: str | None = None
    for unit in ctx.units(len(prompts), result, "prompts"):
        prompt = prompts[unit]
        gen = await ctx.greedy(prompt)
        full: Prompt
        if gen.token_ids is not None and gen.prompt_token_ids is not None:
            full = list(gen.prompt_token_ids) + list(gen.token_ids)
        elif gen.token_ids is not None and isinstance(prompt, list):
            full = prompt + list(gen.token_ids)
        elif isinstance(prompt, str):
            # No ids: trusts that prompt + completion text re-tokenizes into the same tokens.
            full = prompt + gen.text
            result.note("scored text prompts as prompt text + completion text (no token ids)")
        else:
            result.note("server returns no completion token ids: token-id prompts not scored")
            continue
        scored, method = await _teacher_forced(ctx, result, full, method)
        if scored is None:
            result.skip("server has neither POST /v1/score nor echo=true with logprobs")
            return
        n = len(gen.logprobs)
        lps = list(scored.logprobs[-n:]) if n else []
        keys: tuple[Any, ...] = gen.keys
        if scored.token_ids is not None and gen.token_ids is not None:
            keys = tuple(scored.token_ids[-n:]) if n else ()
        ctx.compare(result, gen, _with(gen, keys, lps))
        result.add_cached(gen.cached_tokens)
    if method == SCORE_ENDPOINT and ctx.client.api == "sglang":
        method = "POST /generate (max_new_tokens 0, logprob_start_len 0)"
    result.note(f"teacher forcing through {method}")


SCORE_ENDPOINT = "POST /v1/score"
TEACHER_FORCING = (SCORE_ENDPOINT, "echo=true, max_tokens=0", "echo=true, max_tokens=1")


async def _teacher_forced(
    ctx: ScenarioContext, result: ScenarioResult, full: Prompt, method: str | None
) -> tuple[Scored | None, str | None]:
    """Logprobs of every position of `full`, and the way that gave them. The first call tries
    each of TEACHER_FORCING in turn (a 4xx moves on: vLLM's /v1/score, say, is for
    cross-encoders); later calls use the way that worked, and its refusals are failures."""
    if method is not None:
        return await _score_with(ctx, full, method), method
    for way in TEACHER_FORCING:
        try:
            scored = await _score_with(ctx, full, way)
        except RequestRefused as e:
            result.note(f"{way} refused ({e}); trying the next way")
            continue
        if scored is not None:
            return scored, way
    return None, None


async def _score_with(ctx: ScenarioContext, full: Prompt, way: str) -> Scored | None:
    """None when the server does not offer `way` (no /v1/score; echo without prompt
    logprobs)."""
    if way == SCORE_ENDPOINT:
        return await ctx.client.score(ctx.model, full)
    max_tokens = int(way[-1])
    out = await ctx.client.completion(ctx.model, full, max_tokens=max_tokens, echo=True)
    # With echo, logprobs cover the prompt then the completion; drop the generated token.
    lps = list(out.logprobs)[: len(out.logprobs) - max_tokens]
    if isinstance(full, list) and len(lps) != len(full):
        return None  # echo ignored, or prompt logprobs left out
    return Scored(None, tuple(lps))


def _with(gen: Completion, keys: tuple[Any, ...], logprobs: list[float | None]) -> Completion:
    ids = tuple(keys) if gen.token_ids is not None else None
    tokens = gen.tokens if ids is not None else tuple(keys)
    return Completion(ids, tokens, tuple(logprobs), gen.text, gen.finish_reason, None, None)


def fingerprint_requests() -> list[dict[str, Any]]:
    """The fixed probe requests whose outputs make a fingerprint."""
    rng = random.Random(FINGERPRINT_SEED)
    ids = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(37)]
    reqs: list[dict[str, Any]] = [
        {"prompt": text, "max_tokens": 16, "temperature": 0.0} for text in PROBE_TEXTS[:3]
    ]
    reqs.append({"prompt": ids, "max_tokens": 16, "temperature": 0.0})
    reqs.append({"prompt": PROBE_TEXTS[3], "max_tokens": 16, "temperature": 1.0, "seed": 1234})
    return reqs


async def scenario_restart(ctx: ScenarioContext, result: ScenarioResult) -> None:
    """Fingerprints (tokens and logprobs of fixed probes): `--save` writes them, `--against`
    compares this server's with a file saved earlier (after a restart, on another machine)."""
    save, against = ctx.settings.save, ctx.settings.against
    if save is None and against is None:
        result.skip("needs --save FILE (now) and --against FILE (after a restart)")
        return
    await _fingerprints(ctx, result, fingerprint_requests(), save, against)
    if against is None:
        result.reason = "fingerprints saved; compare after a restart with --against"


def speculative_requests(max_tokens: int) -> list[dict[str, Any]]:
    """Probes that invite copying (prompt lookup finds their continuations in the prompt), so
    that a speculating server keeps drafts: an edit of a paragraph, a code file continued, a
    list, each greedy, and one seeded sample."""
    paragraph = (
        "The river runs through the old town, past the market square and under the stone "
        "bridge, where fishermen sell their catch every morning before the sun is high."
    )
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef "
    prompts = [
        f"Repeat the text, replacing 'river' with 'canal'.\n\nText: {paragraph}\n\nNew text:",
        code,
        "Monday, Tuesday, Wednesday, Thursday, Friday. Again: Monday, Tuesday,",
    ]
    reqs: list[dict[str, Any]] = [
        {"prompt": p, "max_tokens": max_tokens, "temperature": 0.0} for p in prompts
    ]
    reqs.append({"prompt": prompts[0], "max_tokens": max_tokens, "temperature": 0.8, "seed": 7})
    return reqs


async def scenario_speculative(ctx: ScenarioContext, result: ScenarioResult) -> None:
    """A server with speculative decoding against the same server without it: the same
    tokens and logprobs on copy-inviting probes. `lockstep check --serve` runs the probes on
    the server as configured, then on a second one started with `--speculative ngram` (or
    the drafter `--speculative-drafter` names: `speculative_serve_args`), and compares. The probes go one at a time, so that the two
    servers compute them beside the same batch-mates (none) and only speculation differs:
    reference mode then fails this scenario because of speculation alone (the engine's own tests
    cover speculation beside batch-mates)."""
    save, against = ctx.settings.speculative_save, ctx.settings.speculative_against
    if save is None and against is None:
        result.skip("needs --serve: compares the server with a second one that speculates")
        return
    requests = speculative_requests(ctx.settings.max_tokens)
    await _fingerprints(ctx, result, requests, save, against)
    if against is None:
        result.reason = "outputs saved for the speculating server"


async def _fingerprints(
    ctx: ScenarioContext,
    result: ScenarioResult,
    requests: list[dict[str, Any]],
    save: Path | None,
    against: Path | None,
) -> None:
    """Run `requests` one by one; compare the outputs with those saved in `against` (whose
    requests are run instead), and/or save them to `save`."""
    saved: dict[str, Any] | None = None
    if against is not None:
        try:
            saved = json.loads(against.read_text())
        except (OSError, ValueError) as e:
            result.fail(f"--against {against}: cannot read it: {e}")
            return
        if not isinstance(saved, dict) or saved.get("format") != FINGERPRINT_FORMAT:
            result.fail(
                f"--against {against}: not a fingerprint file of format {FINGERPRINT_FORMAT}"
            )
            return
        if saved.get("model") != ctx.model:
            result.note(f"model name differs: saved {saved.get('model')!r}, now {ctx.model!r}")
        requests = [fp["request"] for fp in saved["fingerprints"]]
        before = (saved.get("engine") or {}).get("fingerprint")
        now = (ctx.engine_info or {}).get("fingerprint")
        if before is not None and now is not None and before != now:
            result.note(f"engine fingerprint differs: saved {before!r}, now {now!r}")
    outs: list[Completion] = []
    # Not cut short by the budget: a fingerprint file is only useful complete.
    ctx.set_total(len(requests))
    for req in requests:
        outs.append(
            await ctx.client.completion(
                ctx.model,
                req["prompt"],
                max_tokens=req["max_tokens"],
                temperature=req["temperature"],
                seed=req.get("seed"),
            )
        )
        ctx.advance()
    if saved is not None:
        for fp, out in zip(saved["fingerprints"], outs, strict=True):
            ref = fp["output"]
            # Ids where both runs have them, else token strings on both sides.
            if ref["token_ids"] is not None and out.token_ids is not None:
                ref_keys, keys = list(ref["token_ids"]), list(out.token_ids)
            else:
                ref_keys, keys = list(ref["tokens"]), list(out.tokens)
            diff = compare_runs(ref_keys, ref["logprobs"], keys, out.logprobs, ctx.settings.atol)
            result.add_pair(diff)
    if save is not None:
        doc = {
            "format": FINGERPRINT_FORMAT,
            "model": ctx.model,
            "engine": ctx.engine_info,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "fingerprints": [
                {"request": req, "output": out.to_json()}
                for req, out in zip(requests, outs, strict=True)
            ],
        }
        save.write_text(json.dumps(doc, indent=1) + "\n")
        result.note(f"saved {len(outs)} fingerprints to {save}")


def context_limit(ctx: ScenarioContext) -> tuple[int | None, str]:
    """The context limit and where it came from: /v1/engine, the /v1/models card (vLLM puts
    max_model_len there) or --max-model-len."""
    info = ctx.engine_info or {}
    for where, value in (
        ("GET /v1/engine", info.get("max_model_len")),
        ("GET /v1/engine", (info.get("config") or {}).get("max_model_len")),
        ("GET /v1/models", (ctx.model_card or {}).get("max_model_len")),
        ("--max-model-len", ctx.settings.max_model_len),
    ):
        if isinstance(value, int) and value > 0:
            return value, where
    return None, ""


async def scenario_long(ctx: ScenarioContext, result: ScenarioResult) -> None:
    """Prompts at and past the context limit must be answered or refused with a 4xx, never a
    5xx or a dead connection; /health must answer afterwards."""
    limit, source = context_limit(ctx)
    if limit is None:
        result.skip("context limit unknown: the server has no /v1/engine; pass --max-model-len")
        return
    cases = [(max(1, limit - 8), 4), (limit, 4), (limit + 64, 4)]
    outcomes: list[str] = []
    for i in ctx.units(len(cases), result, "long prompts"):
        n, max_tokens = cases[i]
        try:
            out = await ctx.greedy(ctx.random_ids(n), max_tokens)
        except RequestRefused as e:
            outcomes.append(f"{n} tokens: refused {e.status}")
            continue
        except ServerFault as e:
            result.fail(f"a prompt of {n} tokens (limit {limit}) broke the server: {e}")
            break
        outcomes.append(f"{n} tokens: answered {len(out.logprobs)} tokens")
        result.add_cached(out.cached_tokens)
    if not await ctx.client.health():
        result.fail("GET /health does not answer after the long prompts")
    elif result.status != FAIL:
        result.reason = "answered or refused with a 4xx; /health answers afterwards"
    result.note(f"context limit {limit} (from {source}); " + "; ".join(outcomes))


Scenario = Callable[[ScenarioContext, ScenarioResult], Awaitable[None]]

# In run order: `long` last because it is the one most likely to take a server down.
SCENARIOS: dict[str, Scenario] = {
    "batch": scenario_batch,
    "prefix": scenario_prefix,
    "radix": scenario_radix,
    "score": scenario_score,
    "sampling": scenario_sampling,
    "restart": scenario_restart,
    "speculative": scenario_speculative,
    "long": scenario_long,
}
# The drafters the speculative scenario's second server may use (`--speculative-drafter`):
# prompt lookup, or the model's own multi-token-prediction layer (a model that ships one).
CHECK_DRAFTERS = ("ngram", "mtp")


def speculative_serve_args(drafter: str = "ngram") -> tuple[str, ...]:
    """What the speculative scenario's second server adds to the first one's arguments."""
    if drafter not in CHECK_DRAFTERS:
        raise ValueError(f"drafter {drafter!r}: expected one of {CHECK_DRAFTERS}")
    return ("--speculative", drafter, "--num-draft-tokens", "4")
