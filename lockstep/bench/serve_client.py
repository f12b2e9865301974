"""One request of `lockstep bench serve`, on each API it speaks, timed as it streams.

    generate     POST /generate             SGLang-native: `input_ids` (or `text`),
                                            `sampling_params`, `return_logprob`, `stream`
    completions  POST /v1/completions       `prompt` as token ids (or text)
    chat         POST /v1/chat/completions  one user message (token-id prompts decoded)

Only fields that Lockstep, vLLM and SGLang all take are sent (`ignore_eos` only when asked
for: it is their extension to OpenAI's). A prompt given as text goes as text, token ids as ids.

Timing: the time to first token is from sending the request to the first streamed event that
carries output; the inter-token latencies are the gaps between consecutive such events (an
event usually holds one token). Output tokens are the server's count (`usage` or
`meta_info`'s `completion_tokens`) where it gives one, else the output events seen. A native
stream repeats the whole output so far in every event: new output is a rise of its
`completion_tokens`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from lockstep.bench.workload import BenchRequest
from lockstep.errors import ConfigError
from lockstep.models.tokenizer import Tokenizer

APIS = ("generate", "completions", "chat")
_PATHS = {"generate": "/generate", "completions": "/v1/completions",
          "chat": "/v1/chat/completions"}  # fmt: skip
_ERROR_CHARS = 300


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run asks for, beside its own prompt and output length."""

    api: str
    model: str | None  # not sent to /generate, which serves one model
    stream: bool = True
    temperature: float = 0.0
    ignore_eos: bool = True
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ConfigError(f"--api {self.api!r} is invalid: expected one of {', '.join(APIS)}")
        if self.api != "generate" and not self.model:
            raise ConfigError(f"--api {self.api} needs a model name (--model)")


@dataclass
class Outcome:
    """One request as the client saw it. `error` is None when it succeeded; times in seconds
    from sending it; `ttft_s` and `itl_s` only for streams."""

    error: str | None = None
    prompt_tokens: int | None = None  # the server's count, where it gives one
    output_tokens: int = 0
    counted_by_server: bool = False  # output_tokens is the server's count
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0


class SSEDecoder:
    """Server-sent events from lines (without their line ends): `feed` returns an event's data
    (its `data:` lines joined by newlines) when the blank line that ends it arrives; comments
    and other fields are skipped. `flush` returns an event the stream ended without closing."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:
            return self.flush()
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def request_body(options: RequestOptions, request: BenchRequest, tokenizer: Tokenizer) -> dict:
    """The JSON body of `request` on `options.api`."""
    prompt: str | list[int] = request.text if request.text is not None else request.prompt_ids
    if options.api == "generate":
        body: dict[str, Any] = {
            "text" if isinstance(prompt, str) else "input_ids": prompt,
            "sampling_params": {"max_new_tokens": request.output_len,
                                "temperature": options.temperature,
                                "ignore_eos": options.ignore_eos},
            "return_logprob": options.logprobs,
            "stream": options.stream,
        }  # fmt: skip
        return body
    body = {"model": options.model, "temperature": options.temperature, "stream": options.stream}
    if options.api == "completions":
        body |= {"prompt": prompt, "max_tokens": request.output_len}
        if options.logprobs:
            body["logprobs"] = 0  # the sampled token's only
    else:
        if not isinstance(prompt, str):
            prompt = tokenizer.decode(prompt, skip_special_tokens=True)
        body |= {"messages": [{"role": "user", "content": prompt}],
                 "max_completion_tokens": request.output_len}  # fmt: skip
        if options.logprobs:
            body["logprobs"] = True
    if options.stream:
        body["stream_options"] = {"include_usage": True}
    if options.ignore_eos:
        body["ignore_eos"] = True
    return body


class RequestFailed(Exception):
    """The request failed; the message says how."""


class ResponseReader:
    """What the responses (or stream events) of one request say so far."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.output_seen = 0  # the tokens of read()'s returns

    def read(self, data: Any) -> int:
        """Takes in a response body or stream event; returns the output tokens it adds (the
        rise of the server's count where it gives one, else 1 for an event with output).
        An error event or an aborted request raises `RequestFailed`."""
        if not isinstance(data, dict):
            raise RequestFailed(f"expected a JSON object, got {_clip(json.dumps(data))}")
        if "error" in data:
            raise RequestFailed(f"error event: {_error_message(data)}")
        new = self._read_native(data) if self.api == "generate" else self._read_openai(data)
        self.output_seen += new
        return new

    def _read_native(self, data: dict) -> int:
        meta = data.get("meta_info") or {}
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise RequestFailed(f"aborted by the server: {_clip(json.dumps(finish))}")
        self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
        done = meta.get("completion_tokens")
        if done is None:
            return int(bool(data.get("text") or data.get("output_ids")))
        new = max(done - (self.completion_tokens or 0), 0)
        self.completion_tokens = done
        return new

    def _read_openai(self, data: dict) -> int:
        usage = data.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        choices = data.get("choices") or []
        if not choices:
            return 0
        choice = choices[0]
        if choice.get("finish_reason") == "abort":
            raise RequestFailed("aborted by the server (finish_reason abort)")
        part = choice.get("delta") or choice.get("message") or {}
        text = choice.get("text") if self.api == "completions" else part.get("content")
        return int(bool(text or choice.get("logprobs") or choice.get("token_ids")))


class ServeClient:
    """Sends benchmark requests over one `httpx.AsyncClient` (use it as an async context)."""

    def __init__(
        self, url: str, options: RequestOptions, tokenizer: Tokenizer, timeout_s: float
    ) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            timeout=httpx.Timeout(timeout_s),
            # One connection per request in flight: the load is what --max-concurrency says.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def __aenter__(self) -> ServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def send(
        self, request: BenchRequest, on_output: Callable[[int], None] | None = None
    ) -> Outcome:
        """One request, timed; a failure of any kind is an `Outcome` with its error.
        `on_output(n)` is called for every streamed event that adds n output tokens."""
        outcome = Outcome()
        reader = ResponseReader(self.options.api)
        body = request_body(self.options, request, self.tokenizer)
        path = _PATHS[self.options.api]
        start = time.perf_counter()
        try:
            if self.options.stream:
                await self._stream(path, body, reader, outcome, on_output, start)
            else:
                response = await self._http.post(path, json=body)
                _check_status(response.status_code, response.text)
                reader.read(response.json())
        except RequestFailed as exc:
            outcome.error = str(exc)
        except httpx.HTTPError as exc:
            outcome.error = _clip(f"{type(exc).__name__}: {exc}")
        except (ValueError, TypeError, AttributeError, KeyError) as exc:  # JSON of another shape
            outcome.error = _clip(f"unexpected response ({type(exc).__name__}: {exc})")
        outcome.latency_s = time.perf_counter() - start
        outcome.prompt_tokens = reader.prompt_tokens
        outcome.counted_by_server = reader.completion_tokens is not None
        outcome.output_tokens = (
            reader.completion_tokens if outcome.counted_by_server else reader.output_seen
        )
        return outcome

    async def _stream(
        self,
        path: str,
        body: dict,
        reader: ResponseReader,
        outcome: Outcome,
        on_output: Callable[[int], None] | None,
        start: float,
    ) -> None:
        decoder = SSEDecoder()
        last = start
        async with self._http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                _check_status(response.status_code, text)
            async for line in response.aiter_lines():
                data = decoder.feed(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    return
                now = time.perf_counter()
                new = reader.read(json.loads(data))
                if not new:
                    continue
                if outcome.ttft_s is None:
                    outcome.ttft_s = now - start
                else:
                    outcome.itl_s.append(now - last)
                last = now
                if on_output is not None:
                    on_output(new)
        raise RequestFailed("the stream ended without data: [DONE]")


async def served_model(url: str, timeout_s: float) -> str:
    """The first model `GET /v1/models` lists (the one a single-model server serves)."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            response = await http.get(url.rstrip("/") + "/v1/models")
            _check_status(response.status_code, response.text)
            return response.json()["data"][0]["id"]
    except (httpx.HTTPError, RequestFailed, ValueError, KeyError, IndexError, TypeError) as exc:
        why = _clip(f"{type(exc).__name__}: {exc}")
        raise ConfigError(f"--url {url}: GET /v1/models gave no model name ({why}); is the "
                          "server running? Give the name with --model") from None  # fmt: skip


def _check_status(status: int, text: str) -> None:
    if status != 200:
        try:
            message = _error_message(json.loads(text))
        except (json.JSONDecodeError, AttributeError):
            message = _clip(text)
        raise RequestFailed(f"HTTP {status}: {message}")


def _error_message(body: Any) -> str:
    """The message of an OpenAI-style error body (or FastAPI's `detail`), else the body."""
    error = body.get("error", body.get("detail", body.get("message")))
    if isinstance(error, dict) and "message" in error:
        error = error["message"]
    return _clip(error if isinstance(error, str) else json.dumps(body))


def _clip(text: str) -> str:
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS] + "..."
