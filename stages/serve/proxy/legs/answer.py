"""A decode worker's answer before it becomes the client's response.

The decode leg hands back what the worker answered, not a Starlette response, so the answers of
a fanned-out batch can be merged into one; a single request turns its answer into a response
as it is, without parsing it.

A single request's answer under the client's own id (``for_client``): vLLM names an answer after
the X-Request-Id it got (``"cmpl-<id>"``). Upstream a request goes by eldr's own id, which is
unique whatever the client sends; a client that sent an id of its own reads that one in the
answer, as it would from vLLM. (A split request's merged answer is renamed while it is merged:
``batch_merge.Renames``.)
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class Whole:
    """A non-streamed answer, read to its end."""

    content: bytes
    status: int
    content_type: str


@dataclass(frozen=True)
class Stream:
    """An SSE answer whose first event arrived: blocks of whole events, the last ending in
    ``data: [DONE]`` (after an error event if the worker failed mid-way)."""

    events: AsyncIterator[bytes]
    # Frees the worker's lease and connection; must run once however the stream ends.
    close: Callable[[], Awaitable[None]]
    content_type: str


Answer = Whole | Stream


def for_client(answer: Answer, own_id: str, client_id: str) -> Answer:
    """``answer`` with ``own_id`` (a random hex id, so it appears only where vLLM put it)
    read as ``client_id``, written as JSON would write it."""
    if own_id == client_id:
        return answer
    old = own_id.encode()
    new = orjson.dumps(client_id)[1:-1]
    if isinstance(answer, Whole):
        return Whole(answer.content.replace(old, new), answer.status, answer.content_type)
    events = _renamed(answer.events, old, new)

    async def close() -> None:
        try:
            await events.aclose()
        finally:
            await answer.close()

    return Stream(events, close, answer.content_type)


async def _renamed(
    events: AsyncIterator[bytes], old: bytes, new: bytes
) -> AsyncGenerator[bytes, None]:
    # Blocks of whole events (sse.whole_events): an id never spans two of them.
    async for block in events:
        yield block.replace(old, new)
