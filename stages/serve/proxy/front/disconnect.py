"""Stop working for a client that has gone.

Until the first byte of the answer is ready (prefill, routing, a non-streamed decode, the
wait for a stream's first event) the client is not being written to, so nothing notices it
left. Without a watch, a client timeout would leave a decode running to completion on a
worker, counted in flight. Cancelling the work closes the upstream connections, which makes
vLLM abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


async def unless_client_leaves(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | None:
    """``work()``'s result, or None if the client disconnected first (``work`` is cancelled).

    Call only after the request body was read: the watch consumes ASGI receive messages.

    Plain asyncio, not an anyio task group: this runs once per request, and the task group's
    cancel scopes were a tenth of the proxy's CPU per request. The work stays in this task
    (a task of its own would cost a spawn more); the watch cancels it natively.
    """
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        # The watch can only run while this task waits inside ``work()``, so its cancel
        # always lands there, never after ``work()`` returned.
        return await work()
    except asyncio.CancelledError:
        # Ours alone (no other cancel pending on this task): the client left.
        if left and task.uncancel() == 0:
            return None
        raise
    finally:
        watcher.cancel()
