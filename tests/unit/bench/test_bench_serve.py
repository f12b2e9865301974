"""`lockstep bench serve`'s parts that need no server: the SSE decoder, the reading of each
API's responses and stream events, the request bodies, the arrivals, the percentiles and the
figures of a run. tests/server/test_server_bench_serve.py runs it against a real server."""

from __future__ import annotations

import math
import statistics

import pytest

from lockstep.bench import serve
from lockstep.bench.serve_client import (
    Outcome,
    RequestFailed,
    RequestOptions,
    ResponseReader,
    SSEDecoder,
    request_body,
)
from lockstep.bench.workload import BenchRequest
from lockstep.errors import ConfigError
from lockstep.models.presets import byte_tokenizer

TOKENIZER = byte_tokenizer(512, add_bos=False)


def test_sse_decoder_joins_data_lines_and_skips_comments_and_other_fields() -> None:
    decoder = SSEDecoder()
    lines = [": a comment", "event: message", 'data: {"a":', "data:1}", "", "", "data: [DONE]"]
    events = [e for e in map(decoder.feed, lines) if e is not None]
    assert events == ['{"a":\n1}']  # the blank line after a closed event adds nothing
    assert decoder.flush() == "[DONE]"  # a stream that ends without its blank line
    assert decoder.flush() is None


def test_distribution_ms_interpolates_percentiles() -> None:
    d = serve.distribution_ms([0.001, 0.002, 0.003, 0.004])
    assert d == pytest.approx({"count": 4, "mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97,
                               "max": 4.0})  # fmt: skip
    assert serve.distribution_ms([0.25]) == {"count": 1, "mean": 250.0, "p50": 250.0,
                                             "p90": 250.0, "p99": 250.0, "max": 250.0}  # fmt: skip
    assert serve.distribution_ms([]) is None


def _native(completion_tokens: int, finish: dict | None = None) -> dict:
    meta = {"prompt_tokens": 5, "completion_tokens": completion_tokens, "finish_reason": finish}
    return {"text": "x" * completion_tokens, "output_ids": [7] * completion_tokens,
            "meta_info": meta}  # fmt: skip


def test_native_events_count_the_rise_of_completion_tokens() -> None:
    reader = ResponseReader("generate")
    # Each event repeats the whole output so far; one carries two new tokens.
    assert [reader.read(_native(n)) for n in (1, 3, 3, 4)] == [1, 2, 0, 1]
    assert (reader.prompt_tokens, reader.completion_tokens) == (5, 4)
    with pytest.raises(RequestFailed, match="aborted by the server"):
        reader.read(_native(4, {"type": "abort", "message": "gone"}))


def test_openai_chunks_count_output_events_and_take_the_usage() -> None:
    reader = ResponseReader("chat")
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    token = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    held = {"choices": [{"index": 0, "delta": {"content": ""}, "logprobs": {"content": [{}]}}]}
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
    assert [reader.read(e) for e in (role, token, held, end, usage)] == [0, 1, 1, 0, 0]
    assert (reader.prompt_tokens, reader.completion_tokens, reader.output_seen) == (9, 3, 2)
    completions = ResponseReader("completions")
    assert completions.read({"choices": [{"text": "a", "finish_reason": None}]}) == 1
    assert completions.read({"choices": [{"text": "", "finish_reason": None}]}) == 0
    with pytest.raises(RequestFailed, match="error event: engine died"):
        completions.read({"error": {"message": "engine died", "type": "server_error"}})
    with pytest.raises(RequestFailed, match="abort"):
        completions.read({"choices": [{"text": "", "finish_reason": "abort"}]})


def test_request_bodies_per_api() -> None:
    ids = BenchRequest([104, 105], 4)
    text = BenchRequest([104, 105], 4, text="hi")
    native = request_body(RequestOptions("generate", None, logprobs=True), ids, TOKENIZER)
    assert native == {"input_ids": [104, 105], "return_logprob": True, "stream": True,
                      "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                          "ignore_eos": True}}  # fmt: skip
    assert request_body(RequestOptions("generate", None), text, TOKENIZER)["text"] == "hi"
    plain = RequestOptions("completions", "m", stream=False, ignore_eos=False)
    assert request_body(plain, ids, TOKENIZER) == {
        "model": "m", "temperature": 0.0, "stream": False, "prompt": [104, 105], "max_tokens": 4
    }  # fmt: skip
    chat = request_body(RequestOptions("chat", "m", logprobs=True), ids, TOKENIZER)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]  # ids decoded to text
    assert chat["max_completion_tokens"] == 4 and chat["logprobs"] is True
    assert chat["stream_options"] == {"include_usage": True} and chat["ignore_eos"] is True
    with pytest.raises(ConfigError, match="--api chat needs a model name"):
        RequestOptions("chat", None)
    with pytest.raises(ConfigError, match="--api 'score' is invalid"):
        RequestOptions("score", "m")


def test_arrivals_are_seeded_poisson_gaps() -> None:
    gaps = serve.Arrivals(request_rate=50.0, seed=3).gaps(2000)
    assert gaps[0] == 0.0 and gaps == serve.Arrivals(request_rate=50.0, seed=3).gaps(2000)
    assert gaps != serve.Arrivals(request_rate=50.0, seed=4).gaps(2000)
    assert statistics.mean(gaps[1:]) == pytest.approx(1 / 50.0, rel=0.1)
    assert serve.Arrivals().gaps(3) == [0.0, 0.0, 0.0]
    for bad in ({"request_rate": 0.0}, {"request_rate": -1.0}, {"max_concurrency": 0}):
        with pytest.raises(ConfigError):
            serve.Arrivals(**bad)


def test_summary_counts_failures_and_times_the_completed_requests() -> None:
    requests = [BenchRequest([1] * 10, 5), BenchRequest([1] * 20, 5), BenchRequest([1] * 30, 5)]
    outcomes = [
        Outcome(prompt_tokens=11, output_tokens=5, counted_by_server=True, ttft_s=0.1,
                itl_s=[0.01, 0.03], latency_s=0.5),
        Outcome(prompt_tokens=None, output_tokens=3, ttft_s=0.2, itl_s=[0.02], latency_s=0.4),
        Outcome(error="HTTP 400: too long", latency_s=0.01),
    ]  # fmt: skip
    f = serve.summary(requests, serve.RunResult(outcomes, 2.0, 0.1, 3))
    assert (f["completed"], f["failed"], f["first_error"]) == (2, 1, "HTTP 400: too long")
    assert (f["input_tokens"], f["output_tokens"]) == (11 + 20, 8)  # the server's count first
    assert f["requested_output_tokens"] == 10 and f["output_counted_by_server"] == 1
    assert f["requests_per_s"] == 1.0 and f["output_tok_s"] == 4.0
    assert f["tpot_ms"]["count"] == 2
    assert f["tpot_ms"]["mean"] == pytest.approx(1000 * ((0.4 / 4) + (0.2 / 2)) / 2)
    assert f["itl_ms"]["count"] == 3 and f["e2e_latency_ms"]["max"] == pytest.approx(500.0)
    assert math.isclose(f["ttft_ms"]["p50"], 150.0)


def test_warmup_requests_take_the_first_lengths_with_other_tokens() -> None:
    requests = [BenchRequest([1] * 3, 2), BenchRequest([2] * 5, 4)]
    warm = serve.warmup_requests(requests, 3, 100, seed=0)
    assert [(len(r.prompt_ids), r.output_len) for r in warm] == [(3, 2), (5, 4), (3, 2)]
    assert all(r.text is None for r in warm)
    assert serve.warmup_requests(requests, 0, 100, seed=0) == []
    with pytest.raises(ConfigError, match="--warmup -1"):
        serve.warmup_requests(requests, -1, 100, seed=0)
