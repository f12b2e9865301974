"""`lockstep bench serve` against a real `lockstep serve` (the tiny random preset on the CPU),
on each of its three APIs: every request completes, the JSON document last on stdout counts
them, and the engine generated exactly the tokens asked for (warm-up included), so the client
sent what it says. The control: a server that is down makes every request fail with the
connection error and the command exit 1; without --model, asking it for its model name is a
clear error, exit status 2."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server import ServerProcess

from lockstep.bench.serve import load_tokenizer
from lockstep.bench.workload import LengthRange, random_requests
from lockstep.cli import main

MODEL = "random:tiny"
NUM_PROMPTS, CONCURRENCY, OUTPUT_LEN, WARMUP = 6, 3, 5, 1
WORKLOAD = ["--num-prompts", str(NUM_PROMPTS), "--input-len", "8:24",
            "--output-len", str(OUTPUT_LEN), "--seed", "0", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", MODEL, "--device", "cpu", "--kv-tokens", "4096",
                          "--max-running", "8", "--max-model-len", "512"]).start()  # fmt: skip
    yield proc
    proc.stop()


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict, str]:
    status = main(["bench", "serve", *WORKLOAD, *args])
    out = capsys.readouterr().out
    return status, json.loads(out.strip().splitlines()[-1]), out


@pytest.mark.parametrize(
    "api, extra",
    [
        ("generate", ["--logprobs"]),
        ("completions", []),
        ("chat", []),
        ("generate", ["--no-stream"]),
    ],  # fmt: skip
)
def test_every_request_completes_with_the_tokens_asked_for(
    server: ServerProcess, capsys: pytest.CaptureFixture[str], api: str, extra: list[str]
) -> None:
    before = server.wait_idle()["generated_tokens_total"]
    status, doc, out = _bench(capsys, "--url", server.base_url, "--api", api, "--max-concurrency",
                              str(CONCURRENCY), "--warmup", str(WARMUP), *extra)  # fmt: skip
    assert status == 0, out
    r = doc["results"]
    assert (r["num_requests"], r["completed"], r["failed"]) == (NUM_PROMPTS, NUM_PROMPTS, 0)
    assert r["first_error"] is None and 1 <= r["peak_in_flight"] <= CONCURRENCY
    # ignore_eos (on for random prompts): every request generates what it asked for.
    assert r["output_tokens"] == r["requested_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert r["output_counted_by_server"] == NUM_PROMPTS
    after = server.wait_idle()["generated_tokens_total"]
    assert after - before == (NUM_PROMPTS + WARMUP) * OUTPUT_LEN
    sent = random_requests(NUM_PROMPTS, LengthRange(8, 24), LengthRange(OUTPUT_LEN, OUTPUT_LEN),
                           load_tokenizer(MODEL).vocab_size, seed=0)  # fmt: skip
    if api != "chat":  # token ids in: the server counted exactly the prompts drawn
        assert r["input_tokens"] == sum(len(q.prompt_ids) for q in sent)
    assert r["e2e_latency_ms"]["count"] == NUM_PROMPTS and r["wall_s"] > 0
    if "--no-stream" in extra:
        assert r["ttft_ms"] is None and r["itl_ms"] is None and "TTFT" in out
    else:
        assert r["ttft_ms"]["count"] == NUM_PROMPTS
        assert 0 < r["itl_ms"]["count"] <= NUM_PROMPTS * (OUTPUT_LEN - 1)
        assert r["ttft_ms"]["max"] <= r["e2e_latency_ms"]["max"]
    assert doc["benchmark"] == "serve" and doc["server"]["model"] == MODEL
    assert doc["warmup"]["requests"] == WARMUP and doc["warmup"]["failed"] == 0
    assert doc["command"].startswith(f"lockstep bench serve --url {server.base_url} --api {api}")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_is_down_fails_every_request(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    status, doc, out = _bench(capsys, "--url", url, "--model", MODEL)
    assert status == 1, out
    r = doc["results"]
    assert (r["completed"], r["failed"], r["output_tokens"]) == (0, NUM_PROMPTS, 0)
    assert r["first_error"].startswith("ConnectError") and "first error       Connect" in out
    assert r["e2e_latency_ms"] is None
    assert main(["bench", "serve", *WORKLOAD, "--url", url]) == 2
    assert "GET /v1/models gave no model name" in capsys.readouterr().err


def test_a_prompts_file_of_text_and_ids_through_chat(
    server: ServerProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Text goes as text, token ids are decoded for the chat route; a line's own output_len
    wins over --output-len."""
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello there"}, {"prompt_token_ids": [104, 105, 33], "output_len": 3}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    status = main(["bench", "serve", "--url", server.base_url, "--api", "chat", "--prompts-file",
                   str(path), "--output-len", "4", "--ignore-eos", "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    r = json.loads(out.strip().splitlines()[-1])["results"]
    assert (r["completed"], r["failed"]) == (2, 0)
    assert r["output_tokens"] == r["requested_output_tokens"] == 4 + 3
