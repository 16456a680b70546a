"""Stop working for a client that has gone.

Until the first byte of the answer is ready (prefill, routing, a non-streamed decode, the
wait for a stream's first event) the client is not being written to, so nothing notices it
left. Without a watch, a client timeout would leave a decode running to completion on a
worker, counted in flight. Cancelling the work closes the upstream connections, which makes
vLLM abort the request and free its KV blocks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.types import Receive

T = TypeVar("T")


async def unless_client_leaves(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | None:
    """``work()``'s result, or None if the client disconnected first (``work`` is cancelled).

    Call only after the request body was read: the watch consumes ASGI receive messages.
    """
    results: list[T] = []
    failures: list[Exception] = []

    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        # Only the watch gets a task of its own; the work runs in this one (a task spawn and
        # its cancel scopes are a measurable share of the proxy's per-request CPU).
        group.start_soon(watch)
        try:
            results.append(await work())
        except Exception as exc:
            # Re-raised below as itself, not wrapped in the task group's ExceptionGroup.
            failures.append(exc)
        finally:
            group.cancel_scope.cancel()
    if failures:
        raise failures[0]
    return results[0] if results else None
