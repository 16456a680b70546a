"""A request as the legs take it: everything its path needs, in one frozen ``RequestContext``.

The front makes it once the body has been read and checked (``front.request.request_context``),
so the legs take the request and not a list of its parts; the legs own its type, so they import
nothing of the front. What the two legs send is the front's plan (``front.request.Legs``); the
legs read it through ``LegPayloads``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Protocol

from stages.serve.proxy.state import ProxyState
from stages.serve.proxy.view.kv_routing import Prompt


class Admitted(Protocol):
    """A request let in that holds no worker lease yet (``completions.Admission``)."""

    def settle(self) -> None: ...


class LegPayloads(Protocol):
    """What the two legs of one (sub-)request send, made once (``front.request.plan_legs``):
    a decode retry needs the same prefill again, and the decode body only waits for the
    hand-off."""

    @property
    def prefill(self) -> bytes:
        """The serialised prefill body."""
        ...

    @property
    def key(self) -> bytes:
        """The prompt's prefix-routing key."""
        ...

    @property
    def body(self) -> Mapping[str, Any]:
        """The client's body for this (sub-)request, read only."""
        ...

    @property
    def stream(self) -> bool: ...

    def decode_payload(self, kv_transfer_params: dict[str, Any] | None,
                       tag: str | None = None, record: bool = False) -> bytes:
        """The decode leg's body: the client's, with the prefill's hand-off."""
        ...


@dataclass(frozen=True)
class RequestContext:
    state: ProxyState
    path: str  # the route, the same on the workers (/v1/completions, /v1/chat/completions)
    chat: bool
    # What the workers see as X-Request-Id: eldr's own id, a sub-request's or a retry's (NIXL
    # tracks hand-offs by request id, so no two legs in flight may share one), never the
    # client's, which only the reply carries (two clients may send the same).
    request_id: str
    legs: LegPayloads
    headers: Mapping[str, str]  # for the workers
    reply_headers: Mapping[str, str]  # for the client: the client request's own id
    arrived: float  # time.monotonic() when the client request came in
    # Settled as the legs start (they lease a worker before they first wait), from then on the
    # lease counts the request.
    admission: Admitted
    # The prompt as the workers' KV block hashes (KV-aware routing); None: not known.
    prompt: Prompt | None = None

    @property
    def stream(self) -> bool:
        return self.legs.stream

    def elapsed(self) -> float:
        return time.monotonic() - self.arrived

    def with_request_id(self, request_id: str) -> RequestContext:
        return replace(
            self,
            request_id=request_id,
            headers=MappingProxyType({**self.headers, "X-Request-Id": request_id}),
        )


