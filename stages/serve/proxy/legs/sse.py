"""Server-sent-event framing for the decode stream relay.

The relay forwards whole events only. If a worker dies mid-event, the client then never gets
half a JSON object glued to our error event; it gets every complete event, then the error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson

DONE_EVENT = b"data: [DONE]\n\n"
_SEP = b"\n\n"


def error_event(message: str, code: int = 502, kind: str = "upstream_error") -> bytes:
    payload = {"error": {"message": message, "type": kind, "code": code}}
    return b"data: " + orjson.dumps(payload) + _SEP


def is_done(events: bytes) -> bool:
    """True when the last event of a block of whole events is ``data: [DONE]``."""
    return events.rstrip().endswith(b"data: [DONE]")


class IncompleteEvent(Exception):
    """The upstream body ended inside an event."""


async def whole_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Regroup a byte stream into blocks of complete ``\\n\\n``-terminated events."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        cut = pending.rfind(_SEP)
        if cut < 0:
            continue
        block, pending = pending[: cut + 2], pending[cut + 2 :]
        yield block
    if pending.strip():
        raise IncompleteEvent(f"stream ended inside an event ({len(pending)} bytes pending)")
