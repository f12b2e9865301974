"""Async HTTP client for the endpoints that `lockstep check` drives.

Only what the harness needs: completions with logprobs, scoring, models, health, cache flush
and engine info, through the OpenAI-compatible routes (`api="openai"`) or SGLang's native
`/generate` (`api="sglang"`: generation and teacher-forced scoring both go through it). Responses are parsed into `Completion`s that hold the values exactly as the
server returned them (floats straight from JSON, token ids as given), so that the comparisons
downstream are bitwise on what went over the wire.

Failures are split the way the determinism contract splits them: a 4xx is the server refusing
a request (`RequestRefused`, allowed for e.g. an over-long prompt), while a 5xx, a dropped
connection or a timeout is a fault (`ServerFault`) that no request may ever cause.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

Prompt = str | list[int]
APIS = ("openai", "sglang")
_SGLANG_FINISH = {"length": "length", "stop": "stop", "abort": "abort"}


class ServerFault(Exception):
    """The server answered 5xx, dropped the connection or did not answer in time."""


class RequestRefused(Exception):
    """The server refused a request with a 4xx; `status` is the HTTP status code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class Completion:
    """One choice of a /v1/completions response, as the server returned it.

    `token_ids` is None when the server does not return ids (plain OpenAI servers return only
    token strings); `keys` is then the strings, which is what comparisons use. With echo=true,
    `token_ids` covers only what the server put in `choices[0].token_ids` (Lockstep and vLLM:
    the completion), while `tokens` and `logprobs` cover prompt and completion."""

    token_ids: tuple[int, ...] | None
    tokens: tuple[str, ...]
    logprobs: tuple[float | None, ...]
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    prompt_token_ids: tuple[int, ...] | None = None

    @property
    def keys(self) -> tuple[int, ...] | tuple[str, ...]:
        return self.token_ids if self.token_ids is not None else self.tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "token_ids": list(self.token_ids) if self.token_ids is not None else None,
            "tokens": list(self.tokens),
            "logprobs": list(self.logprobs),
            "text": self.text,
            "finish_reason": self.finish_reason,
        }


@dataclass(frozen=True)
class Scored:
    """Teacher-forced logprobs of a whole sequence: `logprobs[i]` is log p(token i | 0..i-1),
    None at position 0. `token_ids` is None when the server does not say which ids it scored."""

    token_ids: tuple[int, ...] | None
    logprobs: tuple[float | None, ...]


def parse_completion(body: dict[str, Any]) -> Completion:
    """Parse the first choice of a /v1/completions body (raises ValueError on a bad shape)."""
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"completion response has no choices[0]: {str(body)[:200]}") from e
    lp = choice.get("logprobs") or {}
    tokens = tuple(str(t) for t in (lp.get("tokens") or ()))
    logprobs = tuple(lp.get("token_logprobs") or ())
    ids = choice.get("token_ids")
    if ids is None and tokens and all(t.startswith("token_id:") for t in tokens):
        # vLLM's `return_tokens_as_token_ids` spelling.
        ids = [int(t.split(":", 1)[1]) for t in tokens]
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        token_ids=tuple(int(i) for i in ids) if ids is not None else None,
        tokens=tokens,
        logprobs=logprobs,
        text=str(choice.get("text", "")),
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        prompt_token_ids=_ids(choice.get("prompt_token_ids")),
    )


def parse_generate(body: Any, prompt: Prompt, echo: bool) -> Completion:
    """Parse a SGLang `/generate` answer (one output object) into a `Completion`; with
    `echo`, the prompt's logprobs (asked from position 0) come before the output's."""
    try:
        meta = body["meta_info"]
        out = [list(e) for e in meta["output_token_logprobs"]]
        ids = [int(i) for i in body["output_ids"]]
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"/generate response lacks output_ids or logprobs: {str(body)[:200]}"
        ) from e
    entries = ([list(e) for e in meta.get("input_token_logprobs") or ()] if echo else []) + out
    finish = meta.get("finish_reason")
    return Completion(
        token_ids=tuple(ids),
        tokens=tuple(str(e[2]) if e[2] is not None else "" for e in entries),
        logprobs=tuple(e[0] for e in entries),
        text=str(body.get("text", "")),
        finish_reason=_SGLANG_FINISH.get(finish.get("type")) if isinstance(finish, dict) else None,
        prompt_tokens=meta.get("prompt_tokens"),
        cached_tokens=meta.get("cached_tokens"),
        prompt_token_ids=tuple(prompt) if isinstance(prompt, list) else None,
    )


def _ids(value: Any) -> tuple[int, ...] | None:
    return tuple(int(i) for i in value) if isinstance(value, list) else None


def parse_score(body: dict[str, Any]) -> Scored:
    """Parse a /v1/score body: `{"data": [{"token_ids": [...], "logprobs": [null, ...]}]}`,
    or the same keys at the top level."""
    item = body
    if isinstance(body.get("data"), list) and body["data"]:
        item = body["data"][0]
    logprobs = item.get("logprobs")
    if logprobs is None:
        logprobs = item.get("token_logprobs")
    if not isinstance(logprobs, list):
        raise ValueError(f"score response has no logprobs list: {str(body)[:200]}")
    ids = item.get("token_ids")
    return Scored(
        token_ids=tuple(int(i) for i in ids) if ids is not None else None,
        logprobs=tuple(logprobs),
    )


def normalize_base_url(url: str) -> str:
    """Accept `http://host:port`, `.../` or `.../v1` alike."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class CheckClient:
    """The harness's view of one server. At most `concurrency` requests are in flight at once;
    `requests_sent` counts every request made, for the report."""

    def __init__(
        self,
        base_url: str,
        *,
        concurrency: int = 8,
        timeout_s: float = 120.0,
        api_key: str | None = None,
        extra_body: dict[str, Any] | None = None,
        api: str = "openai",
    ) -> None:
        if api not in APIS:
            raise ValueError(f"api={api!r}: expected one of {', '.join(APIS)}")
        self.api = api
        self.base_url = normalize_base_url(base_url)
        self.extra_body = dict(extra_body or {})
        self.requests_sent = 0
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=concurrency + 4),
        )
        self._slots = asyncio.Semaphore(concurrency)
        # `return_token_ids` (Lockstep, vLLM) puts completion ids in each choice; None until
        # the first answer says whether the server accepts the field.
        self._ask_token_ids: bool | None = False if "return_token_ids" in self.extra_body else None

    async def __aenter__(self) -> CheckClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        json_answer: bool = True,
    ) -> Any:
        async with self._slots:
            self.requests_sent += 1
            try:
                resp = await self._http.request(method, path, json=body)
            except httpx.TimeoutException as e:
                raise ServerFault(f"{method} {path}: no answer in time ({type(e).__name__})") from e
            except httpx.TransportError as e:
                raise ServerFault(f"{method} {path}: connection failed ({e!r})") from e
        if resp.status_code >= 500:
            raise ServerFault(f"{method} {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code >= 400:
            raise RequestRefused(resp.status_code, _error_message(resp))
        if not json_answer:
            return None
        try:
            return resp.json()
        except ValueError as e:
            raise ServerFault(f"{method} {path}: answer is not JSON: {resp.text[:200]}") from e

    async def completion(
        self,
        model: str,
        prompt: Prompt,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        echo: bool = False,
    ) -> Completion:
        if self.api == "sglang":
            return await self._generate(prompt, max_tokens, temperature, seed, echo)
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": 1,
        }
        if temperature > 0:
            body["top_p"] = 1.0
        if seed is not None:
            body["seed"] = seed
        if echo:
            body["echo"] = True
        if self._ask_token_ids is not False:
            body["return_token_ids"] = True
        body.update(self.extra_body)
        try:
            data = await self._request("POST", "/v1/completions", body)
        except RequestRefused as e:
            # Servers that refuse unknown fields (OpenAI's own) name the field: ask without it.
            if self._ask_token_ids is not None or "return_token_ids" not in str(e):
                raise
            self._ask_token_ids = False
            del body["return_token_ids"]
            data = await self._request("POST", "/v1/completions", body)
        else:
            if "return_token_ids" in body:
                self._ask_token_ids = True
        try:
            return parse_completion(data)
        except ValueError as e:
            raise ServerFault(str(e)) from e

    async def _generate(
        self, prompt: Prompt, max_tokens: int, temperature: float, seed: int | None, echo: bool
    ) -> Completion:
        """SGLang's `/generate` (max_tokens 0: score the prompt, generate nothing)."""
        sampling: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            sampling["sampling_seed"] = seed
        body: dict[str, Any] = {
            "input_ids" if isinstance(prompt, list) else "text": prompt,
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": 0 if echo else -1,
            "return_text_in_logprobs": True,
            **self.extra_body,
        }
        data = await self._request("POST", "/generate", body)
        try:
            return parse_generate(data, prompt, echo)
        except ValueError as e:
            raise ServerFault(str(e)) from e

    async def score(self, model: str, prompt: Prompt) -> Scored | None:
        """Teacher-forced logprobs from POST /v1/score (SGLang: `/generate` with
        max_new_tokens 0 and the prompt's logprobs from position 0); None when the server has
        no such endpoint (404 or 405)."""
        if self.api == "sglang":
            out = await self._generate(prompt, 0, 0.0, None, echo=True)
            ids = out.prompt_token_ids
            return Scored(token_ids=ids, logprobs=out.logprobs)
        try:
            data = await self._request("POST", "/v1/score", {"model": model, "prompt": prompt})
        except RequestRefused as e:
            if e.status in (404, 405):
                return None
            raise
        try:
            return parse_score(data)
        except ValueError as e:
            raise ServerFault(str(e)) from e

    async def flush_cache(self) -> str | None:
        """Empty the server's prefix cache; returns the endpoint that did it, or None when the
        server has none (SGLang and Lockstep: /flush_cache; vLLM in dev mode:
        /reset_prefix_cache)."""
        for path in ("/flush_cache", "/reset_prefix_cache"):
            try:
                # SGLang answers its flush in plain text.
                await self._request("POST", path, json_answer=False)
            except RequestRefused as e:
                if e.status in (404, 405):
                    continue
                raise
            return path
        return None

    async def get_optional(self, path: str) -> Any | None:
        """GET a JSON endpoint that not every server has; None on 404/405."""
        try:
            return await self._request("GET", path)
        except RequestRefused as e:
            if e.status in (404, 405):
                return None
            raise

    async def models(self) -> list[dict[str, Any]]:
        data = await self._request("GET", "/v1/models")
        return list(data.get("data") or []) if isinstance(data, dict) else []

    async def health(self) -> bool:
        """True when GET /health answers 2xx."""
        self.requests_sent += 1
        try:
            resp = await self._http.get("/health", timeout=10.0)
        except httpx.HTTPError:
            return False
        return resp.status_code < 300


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:300]
        if "detail" in body:
            return str(body["detail"])[:300]
    return str(body)[:300]
