"""`lockstep bench speculative`: batch-1 decode with and without exact speculative decoding on
real-text prompts (docs/speculative.md), outputs compared bit for bit.

Two engines of the same options, one plain and one speculating, run each prompt of a prompts
file alone (batch 1, greedy, cold cache), in turn (A, B, A, B, ...) so that a shared machine's
noise falls on both alike; `repeats` rounds. Per run: the decode time from the first generated
token to the last, so the prompt's prefill is not counted. Reported: each prompt's tokens,
acceptance rate, median ms per generated token plain and speculating, and the speed-up (plain
over speculating); overall, the median over prompts of each prompt's median speed-up and the
total decode time's ratio. Any difference in tokens or logprobs between the two engines makes
the benchmark fail (exit status 1). A human table, then ONE JSON document on the last line.

The prompts file is JSON lines: {"name": ..., "prompt": raw text} or {"name": ..., "user": a
chat message, put through the model's chat template}; `bench/copy_prompts.jsonl` holds prompts
that invite copying (an edited paragraph, a code file continued).
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ConfigError


@dataclass(frozen=True)
class CopyPrompt:
    name: str
    token_ids: list[int]


@dataclass
class PromptResult:
    name: str
    prompt_tokens: int
    generated_tokens: int
    acceptance_rate: float  # drafts kept / drafts proposed, over every run of this prompt
    plain_ms_per_token: float  # medians over the runs
    speculative_ms_per_token: float
    speedup: float  # median over runs of plain / speculative decode time
    identical: bool


def load_prompts(path: Path, engine: Engine) -> list[CopyPrompt]:
    """The prompts file's rows as token ids (a "user" row through the chat template)."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if ("prompt" in row) == ("user" in row):
            raise ConfigError(f"{path}:{number}: expected one of 'prompt' or 'user'")
        text = row.get("prompt")
        if text is None:
            messages = [{"role": "user", "content": row["user"]}]
            text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        name = row.get("name", f"line {number}")
        prompts.append(CopyPrompt(name, engine.tokenizer.encode(text)))
    if not prompts:
        raise ConfigError(f"{path}: no prompts")
    return prompts


def _generate(engine: Engine, prompt: CopyPrompt, max_tokens: int) -> tuple[list, float]:
    """Run one prompt alone on a cold cache; its (token, logprob) pairs and decode seconds
    (first generated token to last)."""
    engine.flush_cache()
    engine.add_request("bench", prompt.token_ids, SamplingParams(max_tokens=max_tokens,
                                                                 temperature=0.0))  # fmt: skip
    pairs: list[tuple[int, float]] = []
    first = last = 0.0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            pairs += list(zip(out.new_token_ids, out.new_token_logprobs, strict=True))
            first = first or now
            last = now
    return pairs, last - first


def bench_speculative(
    plain: Engine, speculating: Engine, prompts: list[CopyPrompt], max_tokens: int, repeats: int
) -> list[PromptResult]:
    """Run every prompt `repeats` times on each engine in turn; see the module docstring."""
    assert speculating.speculator is not None and plain.speculator is None
    counters = speculating.speculator.counters
    results = []
    for prompt in prompts:
        plain_s, spec_s, ratios = [], [], []
        identical = True
        drafted, accepted = counters.drafted, counters.accepted
        tokens = 0
        for _ in range(repeats):
            want, a = _generate(plain, prompt, max_tokens)
            got, b = _generate(speculating, prompt, max_tokens)
            identical &= got == want
            tokens = len(want)
            steps = max(len(want) - 1, 1)  # the decode window holds tokens 2..n
            plain_s.append(a / steps)
            spec_s.append(b / steps)
            ratios.append(a / b if b > 0 else float("inf"))
        drafted, accepted = counters.drafted - drafted, counters.accepted - accepted
        results.append(
            PromptResult(
                name=prompt.name,
                prompt_tokens=len(prompt.token_ids),
                generated_tokens=tokens,
                acceptance_rate=accepted / drafted if drafted else 0.0,
                plain_ms_per_token=1000 * statistics.median(plain_s),
                speculative_ms_per_token=1000 * statistics.median(spec_s),
                speedup=statistics.median(ratios),
                identical=identical,
            )
        )
    return results


def report(results: list[PromptResult], options: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Print the table and return the JSON document."""
    print(f"{'prompt':<26}{'tokens':>7}{'accepted':>10}{'plain ms/tok':>14}{'spec ms/tok':>13}"
          f"{'speed-up':>10}{'same':>6}")  # fmt: skip
    for r in results:
        print(
            f"{r.name:<26}{r.generated_tokens:>7}{r.acceptance_rate:>10.1%}"
            f"{r.plain_ms_per_token:>14.2f}{r.speculative_ms_per_token:>13.2f}"
            f"{r.speedup:>9.2f}x{'yes' if r.identical else 'NO':>6}"
        )
    plain = sum(r.plain_ms_per_token * max(r.generated_tokens - 1, 1) for r in results)
    spec = sum(r.speculative_ms_per_token * max(r.generated_tokens - 1, 1) for r in results)
    median = statistics.median(r.speedup for r in results)
    print(f"median speed-up over prompts: {median:.2f}x; total decode time ratio: "
          f"{plain / spec:.2f}x; outputs identical: {all(r.identical for r in results)}")  # fmt: skip
    return {
        "benchmark": "speculative",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "options": {k: v for k, v in options.items() if v is not None},
        "results": [asdict(r) for r in results],
        "median_speedup": median,
        "total_decode_time_ratio": plain / spec,
        "identical": all(r.identical for r in results),
    }
