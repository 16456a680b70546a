"""A decode worker's answer before it becomes the client's response.

The decode leg hands back what the worker answered, not a Starlette response, so the answers of
a fanned-out batch can be merged into one; a single request turns its answer into a response
as it is, without parsing it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass


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
