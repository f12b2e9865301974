"""Tests of `lockstep check`: the comparison and report logic, and every scenario driven over
real HTTP against a small deterministic completion server defined here (FastAPI + uvicorn on
127.0.0.1), with switches that break one property at a time as negative controls.

The fake "model": token ids are characters (text tokenizes to code points), the greedy next
token and every logprob are CRC32 functions of the prefix, so a sequence's logprobs are a pure
function of its tokens, exactly the contract, until a switch makes them depend on the number
of requests in flight or hides the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from lockstep.check.cli import add_check_parser, serve_args
from lockstep.check.client import normalize_base_url, parse_completion, parse_score
from lockstep.check.compare import FAIL, PASS, SKIP, ScenarioResult, compare_runs
from lockstep.check.report import render_table, write_json, write_plot
from lockstep.check.runner import run_checks
from lockstep.check.scenarios import SCENARIOS, ScenarioSettings

# ---------------------------------------------------------------- the fake server


@dataclass
class FakeBehaviour:
    """Switches for the fake server; the defaults keep the determinism contract."""

    batch_dependent: bool = False  # logprobs shift with the number of requests in flight
    report_cache: bool = True  # usage.prompt_tokens_details.cached_tokens
    has_flush: bool = True
    # POST /v1/score: "yes"; "absent" (404); "refuse" (a 400, as vLLM's cross-encoder
    # /v1/score answers for a generative model). Echo on /v1/completions works regardless.
    score: str = "yes"
    crash_over_limit: bool = False  # a 500 instead of a 400 past the context limit
    max_model_len: int = 300
    # return_token_ids: "honour" (Lockstep, vLLM), "refuse" (a 400 naming it, as OpenAI does
    # for unknown fields) or "ignore".
    token_ids: str = "honour"


def _crc(ids: list[int]) -> int:
    return zlib.crc32(b"".join(i.to_bytes(4, "little") for i in ids))


def _greedy_next(prefix: list[int]) -> int:
    return 300 + _crc(prefix) % 500


def _sampled_next(prefix: list[int], seed: int) -> int:
    return 300 + _crc([*prefix, seed, 7]) % 500


def _logprob(prefix: list[int], token: int) -> float:
    return -(_crc([*prefix, token]) % 100_003) / 10_000 - 0.001


def _tokenize(prompt: Any) -> list[int]:
    return [ord(c) for c in prompt] if isinstance(prompt, str) else [int(t) for t in prompt]


def make_app(b: FakeBehaviour) -> FastAPI:
    app = FastAPI()
    seen: list[list[int]] = []
    state = {"in_flight": 0, "prompt_tokens": 0}

    def cached_prefix(ids: list[int]) -> int:
        best = 0
        for s in seen:
            n = 0
            while n < min(len(s), len(ids)) and s[n] == ids[n]:
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1)  # the last prompt token is always computed

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request"}}, status)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/v1/engine")
    async def engine() -> dict[str, Any]:
        return {
            "max_model_len": b.max_model_len,
            "mode": "fake",
            "fingerprint": "fake-1",
            "stats": {"prompt_tokens_total": state["prompt_tokens"], "num_preemptions": 0},
        }

    if b.has_flush:

        @app.post("/flush_cache")
        async def flush() -> PlainTextResponse:
            seen.clear()
            return PlainTextResponse("Cache flushed.")  # as SGLang answers: not JSON

    if b.score != "absent":

        @app.post("/v1/score")
        async def score(req: Request) -> Any:
            if b.score == "refuse":
                return error(400, "The model does not support the Score API")
            ids = _tokenize((await req.json())["prompt"])
            lps = [None] + [_logprob(ids[:i], ids[i]) for i in range(1, len(ids))]
            return {"data": [{"token_ids": ids, "logprobs": lps}]}

    @app.post("/v1/completions")
    async def completions(req: Request) -> Any:
        body = await req.json()
        if "return_token_ids" in body and b.token_ids == "refuse":
            return error(400, "Unrecognized request argument supplied: return_token_ids")
        ids = _tokenize(body["prompt"])
        max_tokens = int(body.get("max_tokens", 16))
        if len(ids) + max_tokens > b.max_model_len:
            if b.crash_over_limit:
                return JSONResponse({"detail": "workspace overflow"}, 500)
            return error(400, f"prompt of {len(ids)} tokens + max_tokens exceeds the limit")
        if max_tokens == 0 and not body.get("echo"):
            return error(400, "max_tokens=0 needs echo=true")
        state["in_flight"] += 1
        state["prompt_tokens"] += len(ids)
        try:
            temperature, seed = float(body.get("temperature", 1.0)), body.get("seed")
            seq, out, lps = list(ids), [], []
            for _ in range(max_tokens):
                # One "decode step": yield so that concurrent requests overlap as in a batch.
                await asyncio.sleep(0.002)
                shift = 1e-6 * (state["in_flight"] - 1) if b.batch_dependent else 0.0
                nxt = _sampled_next(seq, seed) if temperature > 0 else _greedy_next(seq)
                lps.append(_logprob(seq, nxt) + shift)
                out.append(nxt)
                seq.append(nxt)
        finally:
            state["in_flight"] -= 1
        cached = cached_prefix(ids)
        seen.append(seq)
        if body.get("echo"):
            prompt_lps = [None] + [_logprob(ids[:i], ids[i]) for i in range(1, len(ids))]
            out, lps = ids + out, prompt_lps + lps
        choice: dict[str, Any] = {
            "index": 0,
            "text": "".join(chr(t) for t in out),
            "finish_reason": "length",
            "logprobs": {"tokens": [chr(t) for t in out], "token_logprobs": lps},
        }
        if body.get("return_token_ids") and b.token_ids == "honour":
            choice["token_ids"] = out[-max_tokens:] if max_tokens else []
            choice["prompt_token_ids"] = ids
        usage: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": max_tokens}
        if b.report_cache:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return {"id": "cmpl-fake", "object": "text_completion", "choices": [choice], "usage": usage}

    return app


@pytest.fixture
def fake_server() -> Iterator[Any]:
    """A factory: `fake_server(FakeBehaviour(...))` starts one on 127.0.0.1, returns its URL."""
    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(behaviour: FakeBehaviour | None = None) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(
            uvicorn.Config(make_app(behaviour or FakeBehaviour()), log_level="warning")
        )
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        running.append((server, thread))
        deadline = time.monotonic() + 120  # a hang guard, not a speed test
        while not server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=10)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lockstep")
    add_check_parser(parser.add_subparsers())
    return parser.parse_args(["check", *argv])


def run_cli(argv: list[str]) -> int:
    args = parse([*argv, "--no-progress"])
    return args.func(args)


def by_name(report_json: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in report_json["scenarios"]}


# The tests bound their work by counts (requests, tokens), not by time: the budget only guards
# against a hang, and is large enough that a busy machine never reaches it.
HANG_GUARD = ["--budget-s", "1800"]


def _no_budget_cut(doc: dict[str, Any]) -> None:
    """Fail, naming the cause, when the time budget cut any scenario short."""
    for r in doc["scenarios"]:
        if r.get("truncated_by_budget") or "budget" in (r.get("reason") or ""):
            pytest.fail(f"scenario {r['name']!r} ran out of the {doc['budget_s']} s time budget "
                        f"(the machine is too slow for this test's counts): {r}")  # fmt: skip


# ---------------------------------------------------------------- comparison logic


def test_identical_runs_do_not_diverge() -> None:
    d = compare_runs([1, 2, 3], [-0.5, -1.0, -2.0], [1, 2, 3], [-0.5, -1.0, -2.0])
    assert (d.positions, d.flip_at, d.first_divergence, d.max_abs_delta) == (3, None, None, 0.0)


def test_one_ulp_is_a_divergence_unless_atol_allows_it() -> None:
    a = -1.2345678901234567
    b = -1.2345678901234569  # the next double after a
    assert a != b
    d = compare_runs([1, 2], [-0.5, a], [1, 2], [-0.5, b])
    assert d.first_divergence == 1 and d.flip_at is None and 0 < d.max_abs_delta < 1e-15
    assert compare_runs([1, 2], [-0.5, a], [1, 2], [-0.5, b], atol=1e-12).first_divergence is None


def test_comparison_stops_at_the_first_token_flip() -> None:
    d = compare_runs([1, 2, 3, 4], [-1.0] * 4, [1, 2, 9, 4], [-1.0, -1.0, -3.0, -1.0])
    assert d.flip_at == 2 and d.first_divergence == 2 and d.positions == 3
    assert d.deltas == (0.0, 0.0)  # positions after a flip are not compared


def test_a_run_that_stops_early_flips_where_it_ends() -> None:
    d = compare_runs([1, 2, 3], [-1.0] * 3, [1, 2], [-1.0] * 2)
    assert d.flip_at == 2 and d.positions == 2


def test_missing_logprob_and_signed_zero() -> None:
    assert compare_runs([1], [None], [1], [-0.1]).first_divergence == 0
    assert compare_runs([1], [0.0], [1], [-0.0]).first_divergence is None


def test_scenario_result_turns_divergence_into_fail() -> None:
    r = ScenarioResult("batch")
    r.add_pair(compare_runs([1, 2], [-1.0, -2.0], [1, 2], [-1.0, -2.0]))
    r.finish(atol=0.0)
    assert r.status == PASS and r.positions == 2
    r.add_pair(compare_runs([1, 2], [-1.0, -2.0], [1, 2], [-1.0, -2.5]))
    r.finish(atol=0.0)
    assert r.status == FAIL and "1 of 2 runs differ" in r.reason
    assert r.first_divergence == 1 and r.max_abs_delta == 0.5
    assert r.to_json()["max_abs_delta_by_position"] == [0.0, 0.5]


def test_parse_completion_and_score_shapes() -> None:
    body = {
        "choices": [
            {
                "text": "ab",
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["token_id:5", "token_id:7"],
                    "token_logprobs": [-1.5, -0.25],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}},
    }
    c = parse_completion(body)
    assert c.token_ids == (5, 7) and c.keys == (5, 7) and c.cached_tokens == 2
    del body["usage"]
    body["choices"][0]["logprobs"]["tokens"] = ["a", "b"]
    c = parse_completion(body)
    assert c.token_ids is None and c.keys == ("a", "b") and c.cached_tokens is None
    s = parse_score({"data": [{"token_ids": [1, 2], "logprobs": [None, -0.5]}]})
    assert s.token_ids == (1, 2) and s.logprobs == (None, -0.5)
    assert parse_score({"token_logprobs": [None, -1.0]}).logprobs == (None, -1.0)


def test_base_url_forms() -> None:
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert normalize_base_url(url) == "http://h:1"


def test_cli_arguments() -> None:
    with pytest.raises(SystemExit):
        parse(["--url", "http://x", "--scenarios", "batch,nope"])
    with pytest.raises(SystemExit):
        parse(["--url", "http://x", "--serve"])
    assert parse(["--url", "http://x", "--scenarios", "all"]).scenarios == list(SCENARIOS)
    args = parse(["--serve", "--mode", "reference", "--no-prefix-cache", "--kv-tokens", "4096"])
    assert serve_args(args) == ["--mode", "reference", "--kv-tokens", "4096", "--no-prefix-cache"]
    assert run_cli(["--url", "http://127.0.0.1:9", "--mode", "reference"]) == 2


# ---------------------------------------------------------------- scenarios over HTTP


def test_every_scenario_passes_on_a_deterministic_server(fake_server: Any, tmp_path: Path) -> None:
    url = fake_server()
    fp, out, png = tmp_path / "fp.json", tmp_path / "out.json", tmp_path / "deltas.png"
    argv = ["--url", url, *HANG_GUARD, "--json", str(out), "--plot", str(png)]
    assert run_cli([*argv, "--save", str(fp)]) == 0
    doc = json.loads(out.read_text())
    _no_budget_cut(doc)
    results = by_name(doc)
    assert doc["passed"] and doc["model"] == "fake-model" and list(results) == list(SCENARIOS)
    # The speculative scenario starts a second server of its own: only with --serve.
    assert results.pop("speculative")["status"] == SKIP
    for name, r in results.items():
        assert r["status"] == PASS, (name, r)
        assert r["requests"] > 0
        if name not in ("restart", "long"):
            assert r["positions_compared"] > 0 and r["max_abs_delta_logprob"] == 0.0, name
    assert results["radix"]["cached_tokens"] > 0
    assert any("POST /v1/score" in n for n in results["score"]["notes"])
    counters = doc["engine_counters"]
    assert counters["prompt_tokens_total"] > 0 and counters["num_preemptions"] == 0
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"
    # A later run compares with the saved fingerprints.
    assert (
        run_cli(["--url", url, "--scenarios", "restart", "--against", str(fp), "--json", str(out)])
        == 0
    )
    restart = by_name(json.loads(out.read_text()))["restart"]
    assert restart["status"] == PASS and restart["positions_compared"] == 5 * 16


def test_batch_dependent_logprobs_fail_batch_and_sampling(fake_server: Any, tmp_path: Path) -> None:
    url = fake_server(FakeBehaviour(batch_dependent=True))
    out = tmp_path / "out.json"
    argv = ["--url", url, "--scenarios", "batch,sampling,radix", "--json", str(out)]
    assert run_cli(argv) == 1
    results = by_name(json.loads(out.read_text()))
    for name in ("batch", "sampling"):
        r = results[name]
        assert r["status"] == FAIL and "runs differ" in r["reason"], r
        assert r["first_divergence"] is not None and r["greedy_flips"] == 0
        assert 0 < r["max_abs_delta_logprob"] < 1e-4
    assert results["radix"]["status"] == PASS  # sequential requests: alone every time


def test_radix_fails_when_the_cache_is_not_reported(fake_server: Any, tmp_path: Path) -> None:
    url = fake_server(FakeBehaviour(report_cache=False))
    out = tmp_path / "out.json"
    assert run_cli(["--url", url, "--scenarios", "radix,prefix", "--json", str(out)]) == 1
    results = by_name(json.loads(out.read_text()))
    assert results["radix"]["status"] == FAIL
    assert results["radix"]["reason"].startswith("cache not exercised: proves nothing")
    assert results["radix"]["greedy_flips"] == 0  # the outputs agree: it is the proof that lacks
    assert results["prefix"]["status"] == PASS


@pytest.mark.parametrize("score", ["absent", "refuse"])
def test_server_without_flush_or_score(fake_server: Any, tmp_path: Path, score: str) -> None:
    url = fake_server(FakeBehaviour(has_flush=False, score=score, token_ids="refuse"))
    out = tmp_path / "out.json"
    assert run_cli(["--url", url, "--scenarios", "radix,score", "--json", str(out)]) == 0
    results = by_name(json.loads(out.read_text()))
    assert any("no /flush_cache" in n for n in results["radix"]["notes"])
    assert results["radix"]["runs_compared"] == 3  # cold vs full hit only, on fresh prompts
    r = results["score"]
    assert r["status"] == PASS and "teacher forcing through echo=true, max_tokens=0" in r["notes"]
    assert r["runs_compared"] == 1  # only the text prompt: no ids to score token prompts
    refused = [n for n in r["notes"] if n.startswith("POST /v1/score refused (HTTP 400")]
    assert len(refused) == (score == "refuse")


def test_long_prompt_that_breaks_the_server_fails(fake_server: Any, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    ok = fake_server()
    assert run_cli(["--url", ok, "--scenarios", "long", "--json", str(out)]) == 0
    long = by_name(json.loads(out.read_text()))["long"]
    assert "refused 400" in long["notes"][-1] and "answered 4 tokens" in long["notes"][-1]
    bad = fake_server(FakeBehaviour(crash_over_limit=True))
    assert run_cli(["--url", bad, "--scenarios", "long", "--json", str(out)]) == 1
    long = by_name(json.loads(out.read_text()))["long"]
    assert long["status"] == FAIL and "broke the server" in long["reason"]


def test_restart_against_a_changed_fingerprint_fails(fake_server: Any, tmp_path: Path) -> None:
    url = fake_server()
    fp, out = tmp_path / "fp.json", tmp_path / "out.json"
    assert run_cli(["--url", url, "--scenarios", "restart", "--save", str(fp)]) == 0
    doc = json.loads(fp.read_text())
    doc["fingerprints"][1]["output"]["logprobs"][3] += 2**-40
    fp.write_text(json.dumps(doc))
    assert (
        run_cli(["--url", url, "--scenarios", "restart", "--against", str(fp), "--json", str(out)])
        == 1
    )
    restart = by_name(json.loads(out.read_text()))["restart"]
    assert restart["status"] == FAIL and restart["first_divergence"] == 3
    assert run_cli(["--url", url, "--scenarios", "restart"]) == 0  # nothing to do: skipped
    fp.write_text("{not json")
    assert (
        run_cli(["--url", url, "--scenarios", "restart", "--against", str(fp), "--json", str(out)])
        == 1
    )
    assert "cannot read it" in by_name(json.loads(out.read_text()))["restart"]["reason"]


def test_budget_stops_scenarios_cleanly(fake_server: Any) -> None:
    url = fake_server()
    settings = ScenarioSettings(concurrency=4)
    report = asyncio.run(
        run_checks(url, ["prefix", "batch", "long"], settings, budget_s=0.05, show_progress=False)
    )
    results = {r.name: r for r in report.results}
    assert results["batch"].pairs >= 1  # the first unit always runs
    assert results["batch"].truncated
    assert any("time budget ran out" in n for n in results["batch"].notes)
    for name in ("prefix", "long"):
        assert results[name].status == SKIP and "budget" in results[name].reason
    assert report.passed


def test_report_outputs(fake_server: Any, tmp_path: Path) -> None:
    from rich.console import Console

    url = fake_server(FakeBehaviour(batch_dependent=True))
    report = asyncio.run(
        run_checks(url, ["batch"], ScenarioSettings(concurrency=4), budget_s=5, show_progress=False)
    )
    console = Console(record=True, width=200)
    render_table(report, console)
    text = console.export_text()
    assert "batch" in text and "FAIL" in text and "runs differ" in text
    write_json(report, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is False
    write_plot(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------- end to end, real Lockstep
# `lockstep check --serve` starts `python -m lockstep serve` with the embedded default model
# on the CPU. Small counts keep each run (its server starts and scenarios) under about three
# minutes on 2 cores; the context limit is cut to 512 so that the long scenario's prefill stays
# short. The model's forward passes are most of the time: a run that two tests can share runs
# once per module (lockstep_full_run, lockstep_reference_run).

E2E = ["--max-model-len", "512", "--max-tokens", "8", "--concurrency", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def lockstep_full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, Path, int]:
    """Every scenario against Lockstep in its default (deterministic) mode on a port of our
    choosing, the restart scenario across a real restart of the server (two servers, one
    after the other), saving the fingerprints that a later test compares with a third."""
    from lockstep.check.serve import free_port

    tmp = tmp_path_factory.mktemp("check-e2e")
    fp, out = tmp / "fingerprints.json", tmp / "out.json"
    port = free_port()
    argv = ["--serve", *E2E, "--port", str(port), *HANG_GUARD, "--save", str(fp)]
    code = run_cli([*argv, "--json", str(out)])
    return code, json.loads(out.read_text()), fp, port


def _drafts_kept(speculative: dict[str, Any]) -> int:
    """How many drafts the speculative scenario's second server kept (its note says)."""
    kept = next(n for n in speculative["notes"] if n.startswith("the second server kept"))
    return int(kept.split()[4])  # "the second server kept A of D drafts"


@pytest.mark.slow
def test_lockstep_passes_every_scenario(lockstep_full_run: tuple[int, dict, Path, int]) -> None:
    code, doc, fp, port = lockstep_full_run
    _no_budget_cut(doc)
    results = by_name(doc)
    assert list(results) == list(SCENARIOS)
    for name, r in results.items():
        assert r["status"] == PASS, (name, r)
    assert code == 0 and doc["engine"]["mode"] == "deterministic"
    for name in ("batch", "prefix", "radix", "score", "sampling", "speculative"):
        assert results[name]["positions_compared"] > 0, name
    # The speculative scenario compared with a second server that speculated (prompt lookup)
    # and kept drafts, so verify chunks did run: the same outputs as one-row decode.
    speculative = results["speculative"]
    assert any("--speculative ngram" in n for n in speculative["notes"]), speculative
    assert _drafts_kept(speculative) > 0, speculative
    assert results["radix"]["cached_tokens"] > 0
    assert any(
        n.startswith("context limit 512 (from GET /v1/engine)") for n in results["long"]["notes"]
    )
    assert len(json.loads(fp.read_text())["fingerprints"]) == 5
    restart = results["restart"]
    assert "compared across a restart of the server" in restart["notes"]
    assert restart["positions_compared"] == sum(
        len(f["output"]["logprobs"]) for f in json.loads(fp.read_text())["fingerprints"]
    )
    assert doc["url"] == f"http://127.0.0.1:{port}"
    assert doc["engine_counters"]["cached_tokens_total"] > 0


def test_serve_that_cannot_start_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """`lockstep serve` refusing an option ends the check at once with its log, not a hang."""
    assert run_cli(["--serve", "--serve-arg=--no-such-option", "--serve-timeout-s", "120"]) == 2
    err = capsys.readouterr().err
    assert "exited with code 2 before answering /health" in err and "--no-such-option" in err


@pytest.mark.slow
def test_lockstep_passes_every_scenario_through_generate(tmp_path: Path) -> None:
    """`--api sglang`: the scenarios through SGLang's native /generate (generation, and
    teacher forcing with max_new_tokens 0), the API RL frameworks drive: concurrent bursts,
    cache hits and their cached_tokens, scoring, seeded sampling and the context limit, each
    of which /generate carries in fields of its own. The prefix scenario is left to
    test_lockstep_passes_every_scenario: what it adds to batch and radix (prompts sharing
    prefixes in random orders) is the engine's, whichever route the requests came by."""
    out = tmp_path / "out.json"
    scenarios = "batch,radix,score,sampling,long"
    argv = ["--serve", *E2E, "--api", "sglang", "--scenarios", scenarios, *HANG_GUARD]
    assert run_cli([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    _no_budget_cut(doc)
    results = by_name(doc)
    for name, r in results.items():
        assert r["status"] == PASS, (name, r)
    assert list(results) == scenarios.split(",")
    for name in ("batch", "radix", "score", "sampling"):
        assert results[name]["positions_compared"] > 0, name
    assert results["radix"]["cached_tokens"] > 0
    assert any("POST /generate" in n for n in results["score"]["notes"])


@pytest.fixture(scope="module")
def lockstep_reference_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    """The negative controls' run: Lockstep in reference mode (stock torch), the batch
    scenario, then the speculative one, whose probes go to a second server started with
    `--speculative ngram`. Both scenarios must FAIL; each test below asserts one of them."""
    out = tmp_path_factory.mktemp("check-reference") / "out.json"
    argv = ["--serve", *E2E, "--mode", "reference", "--scenarios", "batch,speculative"]
    code = run_cli([*argv, *HANG_GUARD, "--json", str(out)])
    return code, json.loads(out.read_text())


def _batch_fails(doc: dict[str, Any]) -> None:
    batch = by_name(doc)["batch"]
    assert batch["status"] == FAIL and "runs differ" in batch["reason"], batch
    assert batch["max_abs_delta_logprob"] > 0


@pytest.mark.slow
def test_lockstep_reference_mode_fails_batch(lockstep_reference_run: tuple[int, dict]) -> None:
    """Negative control: plain torch float32 matmuls are not batch-invariant on the CPU."""
    code, doc = lockstep_reference_run
    assert code == 1 and doc["engine"]["mode"] == "reference"
    _batch_fails(doc)


@pytest.mark.slow
def test_lockstep_reference_mode_fails_batch_through_generate(tmp_path: Path) -> None:
    """The same negative control through SGLang's native /generate (`--api sglang`)."""
    out = tmp_path / "out.json"
    argv = ["--serve", *E2E, "--mode", "reference", "--scenarios", "batch", "--api", "sglang"]
    assert run_cli([*argv, *HANG_GUARD, "--json", str(out)]) == 1
    _batch_fails(json.loads(out.read_text()))


@pytest.mark.slow
def test_lockstep_speculative_scenario_fails_in_reference_mode(
    lockstep_reference_run: tuple[int, dict],
) -> None:
    """The speculative scenario runs its probes on the server as given, then on a second one
    started with speculation, and compares. In reference mode (the negative control of the
    speculative scenario that test_lockstep_passes_every_scenario passes in deterministic
    mode) a verify chunk's rows get other bits than one-row decode, so the comparison fails."""
    code, doc = lockstep_reference_run
    result = by_name(doc)["speculative"]
    assert any("--speculative ngram" in n for n in result["notes"]), result
    assert _drafts_kept(result) > 0, result  # drafts were kept: verify chunks did run
    assert result["positions_compared"] > 0
    assert code == 1 and result["status"] == FAIL, result


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_speculative_scenario_with_mtp_drafts_on_deepseek_and_hybrid_models(
    tmp_path: Path, family: str
) -> None:
    """The speculative scenario with MTP drafting: a tiny DeepSeek-V3 or Qwen3.5 (hybrid)
    folder (transformers' own, given a multi-token-prediction layer) served as is and by a
    second server started with `--speculative mtp`: the same outputs, and the second server
    drafted. (Prompt lookup finds nothing to copy in a random model's output.)"""
    drafter = "mtp"
    from tests.support.tiny_hf import add_mtp_layer, save_tiny

    folder = tmp_path / family
    folder.mkdir()
    save_tiny(family, folder, vocab_size=8192)  # the check draws token ids up to 8000
    add_mtp_layer(folder)
    out = tmp_path / "out.json"
    argv = ["--serve", *E2E, "--model", str(folder), "--scenarios", "speculative",
            "--speculative-drafter", drafter, *HANG_GUARD]  # fmt: skip
    code = run_cli([*argv, "--json", str(out)])
    result = by_name(json.loads(out.read_text()))["speculative"]
    assert any(f"--speculative {drafter}" in n for n in result["notes"]), result
    kept = next(n for n in result["notes"] if n.startswith("the second server kept"))
    assert int(kept.split()[-2]) > 0, result  # "... kept A of D drafts": D drafts verified
    assert code == 0 and result["status"] == PASS and result["positions_compared"] > 0, result


@pytest.mark.slow
def test_lockstep_without_prefix_cache(
    lockstep_full_run: tuple[int, dict, Path, int], tmp_path: Path
) -> None:
    """The radix scenario refuses to pass on a cache that is off; the fingerprints saved by the
    first server match this restarted one (the cache being off must not change a bit)."""
    _, first_doc, fp, _ = lockstep_full_run
    if not fp.is_file():
        _no_budget_cut(first_doc)
        pytest.fail(f"the first run saved no fingerprints to {fp}: {by_name(first_doc)['restart']}")
    out = tmp_path / "out.json"
    argv = ["--serve", *E2E, "--no-prefix-cache", "--scenarios", "radix,restart"]
    assert run_cli([*argv, *HANG_GUARD, "--against", str(fp), "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    _no_budget_cut(doc)
    results = by_name(doc)
    assert results["radix"]["status"] == FAIL
    assert results["radix"]["reason"].startswith("cache not exercised: proves nothing")
    assert results["radix"]["greedy_flips"] == 0 and results["radix"]["cached_tokens"] == 0
    assert results["restart"]["status"] == PASS
    saved = json.loads(fp.read_text())["fingerprints"]
    assert results["restart"]["positions_compared"] == sum(
        len(f["output"]["logprobs"]) for f in saved
    )


def test_piped_report_keeps_sentences_whole(capsys: pytest.CaptureFixture[str]) -> None:
    """Output to a pipe (pytest's capture is one) is not wrapped at rich's 80 columns: a
    reason and a note longer than that each stay on one line; the control, rich's own
    default console writing to a file, cuts the same reason."""
    import io

    from rich.console import Console

    from lockstep.check.cli import output_console
    from lockstep.check.runner import CheckReport

    result = ScenarioResult("batch")
    reason = "runs differ: " + "the same request alone and inside a burst gave other bits " * 2
    result.fail(reason.strip())
    result.note("a note that is longer than eighty columns, " * 3)
    report = CheckReport("http://x", "m", None, ScenarioSettings(), 1.0, 1.0, [result])
    render_table(report, output_console())
    out = capsys.readouterr().out
    assert reason.strip() in out and ("a note that is longer than eighty columns, " * 3) in out
    control = io.StringIO()
    render_table(report, Console(file=control))
    assert reason.strip() not in control.getvalue()
