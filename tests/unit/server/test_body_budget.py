"""The byte budget of big request bodies (lockstep/server/request_bodies.py, `BodyBudget`):
chunks take their bytes as they arrive and wait, first come first served, while they do not
fit; a hold gives all its bytes back when it ends; the oldest body still being read never
waits, so bodies waiting for each other's bytes always have one that goes on; a wait that is
cancelled (its body shed or gone) leaves nothing behind."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from lockstep.server.request_bodies import BodyBudget


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_chunks_wait_in_order_and_the_oldest_body_never_waits() -> None:
    async def run() -> None:
        budget = BodyBudget(100)
        async with AsyncExitStack() as stack:
            a, b, c = [await stack.enter_async_context(budget.hold()) for _ in range(3)]
            # b and c take what fits; a (the oldest) goes past the limit rather than wait.
            assert b.try_take(60) and c.try_take(40) and budget.used == 100
            assert a.try_take(30) and budget.used == 130 and a.bytes == 30
            assert not b.try_take(1)  # full: the others wait
            waits = [asyncio.ensure_future(h.take(n)) for h, n in ((c, 20), (b, 10))]
            await _settle()
            assert not any(w.done() for w in waits)
            # a has arrived: the oldest body being read is now b, whose wait ends at once,
            # past the limit; c's goes on (nothing was given back).
            a.done_reading()
            await _settle()
            assert waits[1].done() and not waits[0].done() and budget.used == 140
        # Every hold ended (c's wait with it): every byte back.
        await _settle()
        assert budget.used == 0 and waits[0].cancelled()

    asyncio.run(run())


def test_given_back_bytes_go_to_the_waiters_first_come_first_served() -> None:
    async def run() -> None:
        budget = BodyBudget(100)
        async with AsyncExitStack() as stack:
            oldest = await stack.enter_async_context(budget.hold())
            b, c = [await stack.enter_async_context(budget.hold()) for _ in range(2)]
            async with budget.hold() as big:
                assert big.try_take(100)
                first = asyncio.ensure_future(b.take(70))
                second = asyncio.ensure_future(c.take(10))  # fits alone: waits its turn
                await _settle()
                assert not first.done() and not second.done()
            await _settle()
            assert first.done() and second.done() and budget.used == 80
            assert b.bytes == 70 and c.bytes == 10 and oldest.bytes == 0
        assert budget.used == 0

    asyncio.run(run())


def test_a_cancelled_wait_takes_nothing_and_lets_the_next_one_through() -> None:
    async def run() -> None:
        budget = BodyBudget(100)
        async with budget.hold() as oldest, budget.hold() as b, budget.hold() as c:
            assert oldest.try_take(95)
            gone = asyncio.ensure_future(b.take(50))  # the head of the queue, then shed
            small = asyncio.ensure_future(c.take(5))  # fits, but queued behind it
            await _settle()
            assert not small.done()
            gone.cancel()
            await _settle()
            assert gone.cancelled() and small.done()
            assert b.bytes == 0 and c.bytes == 5 and budget.used == 100
        assert budget.used == 0

    asyncio.run(run())
