"""End-to-end tests of the OpenAI-compatible server.

One real `lockstep serve` process (the embedded SmolLM2-135M on the CPU, deterministic mode,
a small KV pool and step budget) is started for the module and driven with the official
`openai` client, and with httpx where a test needs raw HTTP (malformed bodies, disconnects).
The last tests check that the KV pool is wholly free after everything, then that SIGTERM
drains a running request before the process exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 512
SERVE_ARGS = [
    "--device", "cpu",
    "--kv-tokens", "4096",
    "--max-batch-tokens", "256",
    "--chunk-size", "128",
    "--max-running", "16",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--debug-checks",
]  # fmt: skip
STARTUP_TIMEOUT_S = 300


@dataclass
class ServerProcess:
    """A `lockstep serve --port 0` subprocess; stderr is drained by a thread (so the pipe
    never fills) and kept for failure messages."""

    args: list[str]
    proc: subprocess.Popen | None = None
    base_url: str = ""
    model: str = ""
    log: list[str] = field(default_factory=list)

    def start(self) -> ServerProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep", "serve", "--port", "0", *self.args],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        if not ready.wait(STARTUP_TIMEOUT_S) or not self.base_url:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log[-40:]))
        deadline = time.monotonic() + 300  # a hang guard: a busy machine starts slowly
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("server never became healthy:\n" + "".join(self.log[-40:]))

    def _drain(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if line.startswith("Lockstep serving ") and not ready.is_set():
                # "Lockstep serving <model> on http://host:port"
                _, _, rest = line.strip().partition("Lockstep serving ")
                self.model, _, self.base_url = rest.rpartition(" on ")
                ready.set()
        ready.set()

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def engine_stats(self) -> dict:
        return httpx.get(self.base_url + "/v1/engine", timeout=30).json()["stats"]

    def wait_idle(self, timeout: float = 300) -> dict:
        """The engine stats once no request runs or waits and no KV slot is in use."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
            if idle and stats["kv_in_use"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {stats}")
            time.sleep(0.1)


# Probes /health every 50 ms from a process of its own, so that a test's client threads (their
# GIL) are not what gets timed. Writes one JSON line [seconds, status] per probe.
_HEALTH_PROBE = """
import json, sys, time
from pathlib import Path
import httpx
url, out, stop = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
with httpx.Client(timeout=60) as client, out.open("w") as f:
    while not stop.exists():
        t = time.perf_counter()
        status = client.get(url).status_code
        f.write(json.dumps([time.perf_counter() - t, status]) + "\\n")
        f.flush()
        time.sleep(0.05)
"""


@contextmanager
def health_probe(base_url: str, folder: Path) -> Iterator[list[tuple[float, int]]]:
    """While the block runs, /health is probed from another process; on exit the list holds
    (seconds, status) per probe."""
    probes: list[tuple[float, int]] = []
    out, stop = folder / "health.jsonl", folder / "health.stop"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HEALTH_PROBE, base_url + "/health", str(out), str(stop)]
    )
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text()):  # probing has begun
            assert time.monotonic() < deadline and proc.poll() is None, "the probe never ran"
            time.sleep(0.05)
        yield probes
    finally:
        stop.touch()
        proc.wait(60)
        probes.extend(tuple(json.loads(line)) for line in out.read_text().splitlines())


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(SERVE_ARGS).start()
    yield proc
    proc.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """One raw HTTP client, so consecutive requests share a kept-alive connection. The
    other server test modules import `server` and `http` (a server of their own each)."""
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _post(server: ServerProcess, path: str, body: object, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(
        server.base_url + path, content=content, headers=headers, timeout=60, **kwargs
    )


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- basic routes ------------------------------------------------------------------------


def test_models_health_engine(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    info = httpx.get(server.base_url + "/v1/engine").json()
    assert info["max_model_len"] == MAX_MODEL_LEN
    assert info["mode"] == "deterministic"
    assert info["config"]["kv_tokens"] == 4096
    assert info["fingerprint"]["mode"] == "deterministic"
    assert info["stats"]["kv_total"] == 4096
    assert info["last_engine_failure"] is None


def test_chat_completion_greedy(client: openai.OpenAI, server: ServerProcess) -> None:
    reply = client.chat.completions.create(
        model=server.model,
        messages=_user("What is the capital of France?"),
        max_tokens=20,
        temperature=0,
    )
    choice = reply.choices[0]
    # The reference output of this model (transformers, greedy): docs/models.md.
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.completion_tokens > 0
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    assert reply.system_fingerprint.startswith("lockstep-")


def test_chat_streaming_equals_non_streaming(client: openai.OpenAI, server: ServerProcess) -> None:
    args = dict(model=server.model, messages=_user("Name three colors."), max_tokens=24, seed=5)
    whole = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt as `whole`


def test_completions_streaming_echo_and_batches(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    prompt = "The quick brown fox"
    whole = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=10, temperature=0
    )
    streamed = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    echoed = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=10, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + whole.choices[0].text
    # A list of prompts (text and token ids) answers each, in order.
    ids = httpx.post(
        server.base_url + "/v1/score", json={"model": server.model, "prompt": prompt}
    ).json()["data"][0]["token_ids"]
    batch = client.completions.create(
        model=server.model, prompt=[ids, ids], max_tokens=10, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [whole.choices[0].text] * 2
    assert batch.usage.prompt_tokens == 2 * len(ids)


def test_stop_strings(client: openai.OpenAI, server: ServerProcess) -> None:
    args = dict(model=server.model, messages=_user("Count from 1 to 20."), max_tokens=60)
    free = client.chat.completions.create(**args, temperature=0).choices[0].message.content
    assert "5" in free, free
    stopped = client.chat.completions.create(**args, temperature=0, stop=["5"]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == free[: free.index("5")]


def test_max_completion_tokens_is_max_tokens_on_both_routes(server: ServerProcess) -> None:
    """Load generators written for vLLM send both limits with one value, on completions
    too: accepted, and the limit holds (different values are refused: _bad_cases)."""
    base = {"model": server.model, "temperature": 0, "ignore_eos": True}
    routes = (("/v1/completions", {"prompt": "Once upon a time"}),
              ("/v1/chat/completions", {"messages": _user("Tell me a story.")}))  # fmt: skip
    for path, prompt in routes:
        for limits in ({"max_completion_tokens": 3}, {"max_tokens": 3, "max_completion_tokens": 3}):
            response = _post(server, path, {**base, **prompt, **limits})
            assert response.status_code == 200, (path, limits, response.text)
            assert response.json()["usage"]["completion_tokens"] == 3, (path, limits)


# -- logprobs, seeds, cache, score -------------------------------------------------------


def test_logprobs_with_top_alternatives(client: openai.OpenAI, server: ServerProcess) -> None:
    reply = client.completions.create(
        model=server.model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3
        assert chosen <= 0.0
        assert chosen == max(top.values())  # greedy picks the most likely token

    chat = client.chat.completions.create(
        model=server.model,
        messages=_user("Say hi."),
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == entry.top_logprobs[0].logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_streamed_logprobs_equal_non_streamed(client: openai.OpenAI, server: ServerProcess) -> None:
    args = dict(model=server.model, prompt="Héllo wörld, ", max_tokens=8, seed=3, logprobs=2)
    whole = client.completions.create(**args, echo=True).choices[0].logprobs
    parts = [
        c.choices[0].logprobs for c in client.completions.create(**args, echo=True, stream=True)
    ]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, name)] == getattr(whole, name), name
    assert whole.token_logprobs[0] is None  # the echoed prompt's first position


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, server: ServerProcess) -> None:
    def sample(seed: int, n: int = 1) -> list[str]:
        reply = client.chat.completions.create(
            model=server.model,
            messages=_user("Write a word."),
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            n=n,
        )
        return [c.message.content for c in reply.choices]

    alone = sample(1234)
    assert sample(1234) == alone
    # Choice i of n uses seed + i.
    assert sample(1233, n=2)[1] == alone[0]
    # The same request inside a concurrent batch of others gets the same text.
    seeds = [1234, 7, 1234, 99, 1234, 3]
    with ThreadPoolExecutor(len(seeds)) as pool:
        texts = list(pool.map(sample, seeds))
    assert [texts[i] for i in (0, 2, 4)] == [alone] * 3
    assert len({t[0] for t in texts}) > 1  # different seeds, different samples


def test_logprobs_identical_alone_cached_and_batched(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    """The contract end to end: one prompt's logprobs, cold, from the prefix cache and among
    concurrent batch-mates, compared bit for bit."""
    prompt = "In a quiet village by the sea, an old fisherman " * 3
    salt = f"contract-{time.time_ns()}"

    def run(text: str) -> tuple[object, int]:
        reply = client.completions.create(
            model=server.model,
            prompt=text,
            max_tokens=10,
            temperature=0.7,
            seed=11,
            logprobs=5,
            extra_body={"cache_salt": salt},
        )
        return reply.choices[
            0
        ].logprobs.model_dump(), reply.usage.prompt_tokens_details.cached_tokens

    cold, cold_cached = run(prompt)
    warm, warm_cached = run(prompt)
    assert cold_cached == 0 and warm_cached > 0
    others = [f"Unrelated request number {i}: " + "blah " * (5 * i) for i in range(5)]
    with ThreadPoolExecutor(6) as pool:
        batched = list(pool.map(run, [others[0], others[1], prompt, others[2], others[3]]))
    assert cold == warm == batched[2][0]


def test_cached_tokens_on_repeated_prompt(client: openai.OpenAI, server: ServerProcess) -> None:
    prompt = "Here is a long shared preamble about the history of tea. " * 8
    salt = f"cache-test-{time.time_ns()}"  # a namespace no earlier test used
    args = dict(model=server.model, prompt=prompt, max_tokens=4, temperature=0)
    first = client.completions.create(**args, extra_body={"cache_salt": salt})
    second = client.completions.create(**args, extra_body={"cache_salt": salt})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].text == first.choices[0].text
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200
    server.wait_idle()
    assert server.engine_stats()["kv_cached"] == 0
    third = client.completions.create(**args, extra_body={"cache_salt": salt})
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert third.choices[0].text == first.choices[0].text


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_score_equals_generation_logprobs_bitwise(
    client: openai.OpenAI, server: ServerProcess, temperature: float
) -> None:
    prompt_ids = httpx.post(
        server.base_url + "/v1/score",
        json={"model": server.model, "prompt": "A short poem about rivers:"},
    ).json()["data"][0]["token_ids"]
    gen = client.completions.create(
        model=server.model,
        prompt=prompt_ids,
        max_tokens=12,
        temperature=temperature,
        seed=42,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    choice = gen.model_dump()["choices"][0]
    gen_ids = choice["token_ids"]
    gen_logprobs = choice["logprobs"]["token_logprobs"]
    scored = client.post(
        "/score",
        body={"model": server.model, "prompt": prompt_ids + gen_ids, "top_logprobs": 2},
        cast_to=httpx.Response,
    ).json()
    data = scored["data"][0]
    assert scored["object"] == "score"
    assert data["token_ids"] == prompt_ids + gen_ids
    assert data["logprobs"][0] is None
    assert len(data["logprobs"]) == len(prompt_ids) + len(gen_ids)
    n = len(prompt_ids)
    # Bit for bit: JSON carries a float64 exactly, so == compares the engine's own values.
    assert data["logprobs"][n:] == gen_logprobs
    gen_top = choice["logprobs"]["top_logprobs"]
    score_top = [{e["token"]: e["logprob"] for e in row} for row in data["top_logprobs"][n:]]
    assert score_top == gen_top
    assert scored["usage"]["prompt_tokens"] == n + len(gen_ids)


def test_score_of_chat_messages(server: ServerProcess) -> None:
    body = {
        "model": server.model,
        "messages": _user("Hello") + [{"role": "assistant", "content": "Hi there!"}],
    }
    first = _post(server, "/v1/score", body)
    assert first.status_code == 200, first.text
    again = _post(server, "/v1/score", body).json()
    data = first.json()["data"][0]
    assert data["logprobs"][0] is None
    assert all(lp <= 0.0 for lp in data["logprobs"][1:])
    # The first call cached the conversation's KV and logprobs: the second reuses all but the
    # last position (computed for the token after it) and returns the same bits.
    n = len(data["token_ids"])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert again["data"][0]["logprobs"] == data["logprobs"]


# -- bad input ---------------------------------------------------------------------------

LONG_PROMPT = "word " * (MAX_MODEL_LEN + 50)


def _bad_cases(model: str) -> list[tuple[str, object, int, str | None]]:
    """(path, body, expected status, expected param)."""
    chat = {"model": model, "messages": _user("hi"), "max_tokens": 2}
    comp = {"model": model, "prompt": "hi", "max_tokens": 2}
    return [
        ("/v1/completions", "{not json", 400, None),
        ("/v1/completions", "[1, 2]", 400, None),
        ("/v1/completions", {"model": model}, 400, "prompt"),
        ("/v1/completions", {**comp, "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {**comp, "max_tokens": True}, 400, "max_tokens"),
        ("/v1/completions", {**comp, "temperature": 3.5}, 400, "temperature"),
        ("/v1/completions", {**comp, "temperature": 1e-6}, 400, "temperature"),
        ("/v1/completions", {**comp, "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {**comp, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {**comp, "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {**comp, "n": 0}, 400, "n"),
        ("/v1/completions", {**comp, "seed": -1}, 400, "seed"),
        ("/v1/completions", {**comp, "stop": 5}, 400, "stop"),
        ("/v1/completions", {**comp, "no_such_field": 1}, 400, "no_such_field"),
        ("/v1/completions", {**comp, "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/completions", {**comp, "frequency_penalty": -3}, 400, "frequency_penalty"),
        ("/v1/completions", {**comp, "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ("/v1/completions", {**comp, "suffix": "end"}, 400, "suffix"),
        ("/v1/completions", {**comp, "best_of": 3}, 400, "best_of"),
        ("/v1/completions", {**comp, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {**comp, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {**comp, "prompt": [10**9]}, 400, "prompt"),
        ("/v1/completions", {**comp, "prompt": LONG_PROMPT}, 400, "prompt"),
        ("/v1/completions", {**comp, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        ("/v1/completions", {**comp, "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {**chat, "messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages.0.role",
        ),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            None,
        ),
        # SmolLM2's template reads no `tools`: the model could not see them.
        (
            "/v1/chat/completions",
            {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]},
            400,
            "tools",
        ),
        (
            "/v1/chat/completions",
            {**chat, "tools": [{"type": "function"}]},
            400,
            "tools.0.function",
        ),
        (
            "/v1/chat/completions",
            {**chat, "response_format": {"type": "xml"}},
            400,
            "response_format.type",
        ),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, 400, "top_logprobs"),
        (
            "/v1/chat/completions",
            {**chat, "stream_options": {"include_usage": "yes"}},
            400,
            "stream_options.include_usage",
        ),
        ("/v1/chat/completions", {**chat, "messages": _user(LONG_PROMPT)}, 400, "messages"),
        (
            "/v1/completions",
            {**comp, "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),  # fmt: skip
        (
            "/v1/chat/completions",
            {"model": model, "messages": _user("hi"), "max_completion_tokens": 10**6},
            400,
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 3}, 400, "max_tokens"),
        ("/v1/completions", {**comp, "max_completion_tokens": 3}, 400, "max_tokens"),
        ("/v1/score", {"model": model}, 400, "prompt"),
        ("/v1/score", {"model": model, "prompt": "hi", "top_logprobs": 99}, 400, "top_logprobs"),
        ("/v1/score", {"model": model, "prompt": LONG_PROMPT}, 400, "prompt"),
    ]


def test_bad_input_gets_openai_style_4xx(server: ServerProcess) -> None:
    before = server.engine_stats()
    for path, body, status, param in _bad_cases(server.model):
        response = _post(server, path, body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", (body, error)
        assert error["message"], body
        if param is not None:
            assert error["param"] == param, (body, error)
    # Refused before any work: nothing was admitted to the engine.
    after = server.engine_stats()
    assert after["prompt_tokens_total"] == before["prompt_tokens_total"]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_bad_input_through_the_official_client(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model, messages=_user("hi"), presence_penalty=5.0
        )
    assert "presence_penalty" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    assert httpx.get(server.base_url + "/no/such/route").status_code == 404
    assert httpx.get(server.base_url + "/v1/completions").status_code == 405


# -- disconnects, metrics, drain ---------------------------------------------------------


def test_client_disconnect_frees_slots(server: ServerProcess) -> None:
    server.wait_idle()
    before = server.engine_stats()
    long = {"model": server.model, "prompt": "Tell me a story.", "max_tokens": 480,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=60) as http:
        for path, body in [
            ("/v1/completions", {**long, "stream": True}),
            ("/v1/chat/completions",
             {"model": server.model, "messages": _user("Story?"), "max_tokens": 480,
              "ignore_eos": True, "stream": True}),
        ]:  # fmt: skip
            with http.stream("POST", server.base_url + path, json=body) as response:
                assert response.status_code == 200
                events = 0
                for line in response.iter_lines():
                    events += line.startswith("data:")
                    if events >= 3:
                        break  # leaving the block closes the connection mid-stream
            server.wait_idle()
    # A non-streaming request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=long, timeout=0.3)
    stats = server.wait_idle()
    generated = stats["generated_tokens_total"] - before["generated_tokens_total"]
    # Had any of the three run to its end, it alone would have generated 480 tokens.
    assert generated < 480, f"aborted requests kept generating: {generated} tokens"
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]


def test_metrics(server: ServerProcess) -> None:
    text = httpx.get(server.base_url + "/metrics").text
    for name in (
        "lockstep_requests_running",
        "lockstep_requests_waiting",
        "lockstep_kv_tokens_in_use",
        "lockstep_kv_usage_ratio",
        "lockstep_prefix_cache_hit_rate",
        "lockstep_generation_tokens_per_second",
        "lockstep_time_to_first_token_seconds_bucket",
        "lockstep_inter_token_latency_seconds_bucket",
    ):
        assert name in text, name
    ttft_count = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("lockstep_time_to_first_token_seconds_count")
    )
    assert ttft_count > 0


def test_kv_pool_wholly_free_after_all_tests(server: ServerProcess) -> None:
    """Runs after every test above that used the server (pytest keeps file order)."""
    stats = server.wait_idle()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_in_use"] == 0
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
    httpx.post(server.base_url + "/flush_cache")
    assert server.engine_stats()["kv_free"] == stats["kv_total"]


def test_sigterm_drains_running_request(server: ServerProcess) -> None:
    """Last: ends the module's server. A request running at SIGTERM still completes."""
    body = {"model": server.model, "prompt": "Count:", "max_tokens": 60, "ignore_eos": True,
            "stream": True}  # fmt: skip
    finish_reasons = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            if server.proc.poll() is None and not finish_reasons:
                server.proc.send_signal(signal.SIGTERM)
                finish_reasons.append("signalled")
            if line != "data: [DONE]":
                finish_reasons.append(json.loads(line[5:])["choices"][0]["finish_reason"])
    assert finish_reasons[-1] == "length"
    assert server.proc.wait(30) is not None
    with pytest.raises(httpx.TransportError):
        httpx.get(server.base_url + "/health", timeout=2)


def test_cli_errors_are_one_line_exit_2() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for bad in (["--kv-tokens", "0"], ["--model", "/no/such/model.gguf"]):
        done = subprocess.run(
            [sys.executable, "-m", "lockstep", "serve", "--port", "0", *bad],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lockstep serve: error:"), done.stderr


# -- engine failures (a fake engine in-process: the real one cannot be made to fail) ---------


class _ByteTokenizer:
    vocab_size = 257
    eos_token_ids = frozenset({256})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(t for t in ids if t < 256).decode(errors="replace")

    def token_str(self, token_id: int) -> str:
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


class _FaultyEngine:
    """The `Engine` interface with a trivial model (always emits "a") and a switch that makes
    `step()` raise, as an engine bug would."""

    def __init__(self) -> None:
        from lockstep.config import EngineConfig

        self.config = EngineConfig(device="cpu", max_model_len=64)
        self.model_name = "faulty"
        self.tokenizer = _ByteTokenizer()
        self.max_model_len = 64
        self.pool = types.SimpleNamespace(num_slots=4096)
        self.fail_after = -1  # steps until step() raises; -1: never
        self.requests: dict[str, tuple[list[int], Any, list[int]]] = {}
        self.streams: list[bool] = []  # each add_request's `stream`

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: Any,
        *,
        namespace: str | None = None,
        stream: bool = False,
    ) -> None:
        self.requests[request_id] = (list(prompt), params, [])
        self.streams.append(stream)

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list:
        from lockstep.engine.outputs import StepOutput

        if self.fail_after == 0:
            self.fail_after = -1
            raise RuntimeError("injected engine fault")
        self.fail_after -= self.fail_after > 0
        time.sleep(0.01)
        outputs = []
        for request_id, (prompt, params, out) in list(self.requests.items()):
            out.append(97)
            finished = len(out) >= params.max_tokens
            outputs.append(
                StepOutput(
                    request_id,
                    [97],
                    "a",
                    None,
                    finished,
                    "length" if finished else None,
                    len(prompt),
                    0,
                    len(out),
                    0,
                )  # fmt: skip
            )
            if finished:
                del self.requests[request_id]
        return outputs

    def flush_cache(self) -> int:
        return 0

    def stats(self) -> dict:
        return {"num_running": len(self.requests), "num_waiting": 0, "kv_in_use": 0}

    def fingerprint(self) -> dict:
        return {"engine": "faulty", "weight_version": "default"}

    kv_budget = None  # the pool was not sized from memory

    def memory_bound(self) -> None:
        return None  # not on CUDA


@pytest.fixture
def faulty() -> Iterator[tuple[str, _FaultyEngine]]:
    import socket

    import uvicorn

    from lockstep.server.api import build_app

    engine = _FaultyEngine()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while not server.started:
        time.sleep(0.02)
    yield base, engine
    server.should_exit = True
    thread.join(10)


def test_engine_fault_is_a_500_and_the_server_keeps_serving(
    faulty: tuple[str, _FaultyEngine],
) -> None:
    base, engine = faulty
    body = {"model": "faulty", "prompt": "hi", "max_tokens": 20}
    engine.fail_after = 3
    response = httpx.post(base + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    # Mid-stream the status line is gone: the error arrives in-band, then the stream ends as
    # every stream does.
    engine.fail_after = 3
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert "injected engine fault" in json.loads(events[-2][5:])["error"]["message"]
    assert httpx.get(base + "/health").status_code == 200
    assert "injected engine fault" in httpx.get(base + "/v1/engine").json()["last_engine_failure"]
    ok = httpx.post(base + "/v1/completions", json=body, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "a" * 20
    assert engine.requests == {}


def test_streamed_requests_reach_the_engine_as_streamed(faulty: tuple[str, _FaultyEngine]) -> None:
    """The scheduler bounds the steps that stall streamed decodes only
    (lockstep/engine/step_budget.py): every route tells the engine whether its client streams."""
    base, engine = faulty
    for route, body in (
        ("/v1/completions", {"model": "faulty", "prompt": "hi", "max_tokens": 3}),
        ("/v1/chat/completions",
         {"model": "faulty", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}}),
    ):  # fmt: skip
        for stream in (False, True):
            engine.streams.clear()
            with httpx.stream("POST", base + route, json={**body, "stream": stream}) as r:
                assert r.status_code == 200, (route, r.read())
                r.read()
            assert engine.streams == [stream], route
