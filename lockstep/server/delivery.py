"""How a request group's outputs reach the client: gathered to the end (watching for the
client going away) or streamed as server-sent events; either way, leaving aborts whatever
still runs, so no KV slot outlives its HTTP request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from lockstep.engine.outputs import StepOutput
from lockstep.server.async_engine import EngineFailure, RequestGroup
from lockstep.server.http_errors import engine_failure_error
from lockstep.server.responses import sse

_DISCONNECT_POLL_S = 0.25


class Accumulator(Protocol):
    """Gathers one engine request's outputs (`responses.ChoiceState` is one)."""

    def add(self, output: StepOutput) -> None: ...


async def run_to_end(group: RequestGroup, choices: Sequence[Accumulator], request: Request) -> bool:
    """Feeds every output into its choice until all finish. Returns False if the client went
    away first; the caller's `async with group` then aborts what is left."""

    async def consume() -> None:
        async for index, output in group.outputs():
            choices[index].add(output)

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                task.result()
                return True
            if await request.is_disconnected():
                return False
    finally:
        task.cancel()


def streaming(chunks: AsyncIterator[str], group: RequestGroup) -> StreamingResponse:
    """An SSE response of `chunks`; an engine failure mid-stream becomes an error event."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except EngineFailure as exc:
            # The status line is long gone: report in-band, as OpenAI's streams do, and end
            # the stream the way every stream ends.
            yield sse(engine_failure_error(exc).body())
            yield sse("[DONE]")
        finally:
            # Client gone (the stream is cancelled) or done: free whatever still runs.
            group.abort()

    return StreamingResponse(
        body(), media_type="text/event-stream", background=BackgroundTask(group.abort)
    )
