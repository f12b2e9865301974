"""`lockstep bench throughput`: the JSON line, the step accounting behind its phases, the
workload it draws, and the bitwise spot check, with its negative control (the reference mode,
whose CPU matmuls change a row's bits with the batch, must fail it through the same code)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep.bench import throughput
from lockstep.bench.spot_check import Generation, first_difference
from lockstep.bench.workload import LengthRange, file_requests, random_requests
from lockstep.cli import main
from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.errors import ConfigError

# 8 requests through a 64-token step budget: prefills in chunks beside decoding requests.
ENGINE = ["--model", "random:tiny", "--device", "cpu", "--max-batch-tokens", "64",
          "--chunk-size", "32", "--max-running", "8", "--kv-tokens", "2048"]  # fmt: skip
WORKLOAD = ["--num-prompts", "8", "--input-len", "16:48", "--output-len", "8:24",
            "--no-progress"]  # fmt: skip


def _bench(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict, str]:
    status = main(["bench", "throughput", *WORKLOAD, *ENGINE, *extra])
    out = capsys.readouterr().out
    return status, json.loads(out.strip().splitlines()[-1]), out


def test_json_line_holds_the_figures_and_the_spot_check_passes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, doc, out = _bench(capsys, "--spot-check", "3")
    assert status == 0, out
    assert doc["benchmark"] == "throughput" and "spot check        passed" in out
    r = doc["results"]
    assert r["num_requests"] == 8 and r["wall_s"] > 0
    assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
    assert r["total_tok_s"] == pytest.approx((r["input_tokens"] + r["output_tokens"]) / r["wall_s"])
    assert r["prefill_steps"]["steps"] > 0 and r["decode_steps"]["steps"] > 0
    assert r["prefill_steps"]["prefill_tok_s"] > 0 and r["decode_steps"]["decode_tok_s"] > 0
    assert sum(b["steps"] for b in r["decode_by_context"]) == r["decode_steps"]["steps"]
    assert r["steps_s"] <= r["wall_s"]
    assert doc["kv"]["capacity_tokens"] == 2048 and 0 < r["kv_peak_tokens"] <= 2048
    assert doc["kv"]["linear_snapshots"] == 0  # a model without linear attention
    assert doc["spot_check"] == {"requests": doc["spot_check"]["requests"], "passed": True,
                                 "mismatches": []} and len(doc["spot_check"]["requests"]) == 3  # fmt: skip
    assert doc["engine"]["max_running"] == 8 and doc["engine"]["device"] == "cpu"
    assert doc["fingerprint"]["ops_backend"] == "cpu_deterministic"
    assert doc["options"]["input_len"] == "16:48" and doc["options"]["ignore_eos"] is True
    assert doc["command"].startswith("lockstep bench throughput --num-prompts 8 --input-len")
    assert "--max-batch-tokens 64" in doc["command"]


def test_negative_control_reference_mode_fails_the_spot_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Reference mode's CPU matmuls round a row differently with the number of rows, so requests
    re-run alone differ from their batched run: the same comparison must say so and the
    command must exit with status 1."""
    status, doc, out = _bench(capsys, "--spot-check", "8", "--mode", "reference")
    assert status == 1
    assert doc["spot_check"]["passed"] is False and doc["spot_check"]["mismatches"]
    assert "spot check        FAILED" in out


def _engine(**options: object) -> Engine:
    base = dict(model="random:tiny", device="cpu", max_batch_tokens=64, chunk_size=32,
                max_running=8, kv_tokens=2048)  # fmt: skip
    return Engine(EngineConfig(**(base | options)))


def _workload(n: int = 8, seed: int = 0) -> tuple[list, list]:
    requests = random_requests(n, LengthRange(16, 48), LengthRange(8, 24), 512, seed)
    params = throughput.request_params(requests, {"temperature": 0.0}, True, seed)
    return requests, params


def test_step_accounting_adds_up_to_the_work_done() -> None:
    """Every prompt token is a prefill row, and every generated token comes from a decode row
    or from the row that completes a prompt: the phases count exactly the work."""
    engine = _engine()
    requests, params = _workload()
    run = throughput.run_requests(engine, [r.prompt_ids for r in requests], params,
                                  progress=False)  # fmt: skip
    t = run.times
    assert t.prefill.prefill_rows == run.input_tokens == sum(len(r.prompt_ids) for r in requests)
    assert t.prefill.decode_rows + t.decode.decode_rows + len(requests) == run.output_tokens
    assert run.output_tokens == sum(r.output_len for r in requests)  # ignore_eos
    assert sum(p.decode_rows for p in t.by_context.values()) == t.decode.decode_rows
    assert run.preemptions == 0 and run.cached_tokens == 0
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_step_log_and_host_breakdown_account_for_every_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--step-log` writes one line per timed step; the lines add up to the phases of the JSON
    document (steps, rows, seconds, device waits, steps not launched ahead), and no wait
    exceeds its step. On the CPU nothing is launched ahead (overlapped decode is off)."""
    log = tmp_path / "steps.jsonl"
    status, doc, out = _bench(capsys, "--spot-check", "0", "--step-log", str(log))
    assert status == 0, out
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    r = doc["results"]
    pre, dec = r["prefill_steps"], r["decode_steps"]
    assert len(steps) == pre["steps"] + dec["steps"]
    assert sum(s["prefill_rows"] for s in steps) == r["input_tokens"]
    decode = [s for s in steps if not s["prefill_rows"]]
    assert sum(s["decode_rows"] for s in decode) == dec["decode_rows"]
    assert sum(s["seconds"] for s in steps) == pytest.approx(r["steps_s"])
    assert sum(s["wait_s"] for s in decode) == pytest.approx(dec["device_wait_s"])
    assert all(0 <= s["wait_s"] <= s["seconds"] and s["gc_s"] >= 0 for s in steps)
    assert not any(s["launched_ahead"] for s in steps)
    assert dec["not_launched_ahead"] == dec["steps"]
    assert "waited" in out and "garbage collection" in out


def test_garbage_collections_in_a_step_are_charged_to_it() -> None:
    """A full collection run inside one step shows in that step's record and in the run's
    totals, which are the sum of the steps' records."""
    import gc

    engine = _engine()
    requests, params = _workload(n=2)
    step = engine.step
    calls = [0]

    def step_with_a_collection():
        calls[0] += 1
        if calls[0] == 3:
            gc.collect()
        return step()

    engine.step = step_with_a_collection
    run = throughput.run_requests(engine, [r.prompt_ids for r in requests], params,
                                  progress=False)  # fmt: skip
    assert run.gc_collections[2] >= 1 and run.gc_s > 0
    assert run.steps[2].gc_s > 0
    assert run.gc_s == pytest.approx(sum(s.gc_s for s in run.steps))


def test_preempted_requests_still_repeat_their_bits() -> None:
    """A pool too small for the whole batch preempts and recomputes; the spot check over
    every request still passes (recomputation gives the same bits)."""
    engine = _engine(kv_tokens=240, output_reserve=0.0)  # admitted on the first chunk: preempts
    requests, params = _workload()
    run, check, _ = throughput.bench_throughput(engine, requests, params, warmup=False,
                                                spot_checks=8, progress=False)  # fmt: skip
    assert run.preemptions > 0
    assert check.passed and check.requests == list(range(8))


def test_warm_up_runs_the_shapes_then_leaves_a_cold_idle_engine() -> None:
    engine = _engine()
    requests, params = _workload()
    warm_s = throughput.warm_up(engine, requests, params, seed=0)
    # 8 prompts of 16-48 tokens through 64-token steps: at most 6 prefill steps, plus 8.
    steps = -(-sum(len(r.prompt_ids) for r in requests) // 64) + 8
    assert warm_s > 0
    assert engine.generated_tokens_total == sum(min(r.output_len, steps) for r in requests)
    assert engine.radix.num_cached_tokens == 0 and engine.pool.num_free == engine.pool.num_slots
    assert not engine.has_unfinished()


def test_first_difference_compares_bits() -> None:
    a = Generation([5, 6, 7], [-1.5, -0.25, 0.0])
    assert first_difference(0, a, Generation([5, 6, 7], [-1.5, -0.25, 0.0])) is None
    ulp = Generation([5, 6, 7], [-1.5, -0.25 + 2**-55, 0.0])
    m = first_difference(3, a, ulp)
    assert m is not None and (m.request, m.position, m.what) == (3, 1, "logprob")
    zero = first_difference(0, a, Generation([5, 6, 7], [-1.5, -0.25, -0.0]))
    assert zero is not None and zero.position == 2  # -0.0 == 0.0 numerically, not bitwise
    token = first_difference(0, a, Generation([5, 9, 7], [-1.5, -0.25, 0.0]))
    assert token is not None and token.what == "token" and (token.expected, token.got) == (6, 9)
    short = first_difference(0, a, Generation([5, 6], [-1.5, -0.25]))
    assert short is not None and short.what == "length" and short.position == 2


def test_length_ranges_and_random_prompts_are_reproducible() -> None:
    assert LengthRange.parse("1024", "--input-len") == LengthRange(1024, 1024)
    assert LengthRange.parse("512:2048", "--input-len") == LengthRange(512, 2048)
    for bad in ("0", "9:3", "a", "1:2:3", ""):
        with pytest.raises(ConfigError, match="--input-len"):
            LengthRange.parse(bad, "--input-len")
    one = random_requests(20, LengthRange(4, 9), LengthRange(2, 5), 100, seed=1)
    assert one == random_requests(20, LengthRange(4, 9), LengthRange(2, 5), 100, seed=1)
    assert one != random_requests(20, LengthRange(4, 9), LengthRange(2, 5), 100, seed=2)
    assert {len(r.prompt_ids) for r in one} <= set(range(4, 10))
    assert {r.output_len for r in one} <= set(range(2, 6))
    assert all(0 <= t < 100 for r in one for t in r.prompt_ids)


def test_prompts_file_takes_text_or_ids(tmp_path: Path) -> None:
    engine = _engine()
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello"}, {"prompt_token_ids": [1, 2, 3], "output_len": 4}, {}]
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n")
    got = file_requests(path, engine.tokenizer, None, LengthRange(7, 7), seed=0)
    assert [r.prompt_ids for r in got] == [engine.tokenizer.encode("hello"), [1, 2, 3]]
    assert [r.output_len for r in got] == [7, 4]
    with pytest.raises(ConfigError, match="holds 2 prompts: expected 3"):
        file_requests(path, engine.tokenizer, 3, LengthRange(7, 7), seed=0)
    path.write_text(json.dumps(lines[2]) + "\n")
    with pytest.raises(ConfigError, match=r"prompts.jsonl:1: expected exactly one of"):
        file_requests(path, engine.tokenizer, None, LengthRange(7, 7), seed=0)


def test_filters_without_a_temperature_are_refused() -> None:
    requests = random_requests(2, LengthRange(4, 4), LengthRange(2, 2), 100, seed=0)
    with pytest.raises(ConfigError, match="--temperature"):
        throughput.request_params(requests, {"temperature": 0.0, "top_p": 0.9}, True, 0)


def test_the_progress_bar_counts_output_tokens_to_the_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The bar counts output tokens as they come (requests of similar length finish
    together, at the end, so a bar of requests sits still) and is left showing the total."""
    engine = _engine()
    requests, params = _workload()
    throughput.run_requests(engine, [r.prompt_ids for r in requests], params, progress=True)
    total = sum(r.output_len for r in requests)
    last = capsys.readouterr().err.replace("\n", "\r").rstrip("\r").split("\r")[-1]
    assert f"{total}/{total}" in last, last
