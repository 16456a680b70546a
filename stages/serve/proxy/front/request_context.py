"""One client request, or one sub-request of a fanned-out batch, as the legs see it.

Everything a request's path needs travels in one frozen ``RequestContext``, made when the body
has been read and checked, so the legs take the request and not a list of its parts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from starlette.requests import Request

from stages.serve.proxy.front.admission import Admission
from stages.serve.proxy.front.payloads import Legs, plan_legs
from stages.serve.proxy.state import ProxyState
from stages.serve.proxy.view.kv_routing import Prompt

# Client headers worth carrying to the workers. Not Authorization: the client's key is the
# proxy's to check, and workers get the proxy's own key (upstream.worker_headers).
_FORWARDED = ("traceparent", "tracestate")
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class RequestContext:
    state: ProxyState
    path: str  # the route, the same on the workers (/v1/completions, /v1/chat/completions)
    chat: bool
    # What the workers see as X-Request-Id: eldr's own id, a sub-request's or a retry's (NIXL
    # tracks hand-offs by request id, so no two legs in flight may share one), never the
    # client's, which only the reply carries (two clients may send the same).
    request_id: str
    legs: Legs
    headers: Mapping[str, str]  # for the workers
    reply_headers: Mapping[str, str]  # for the client: the client request's own id
    arrived: float  # time.monotonic() when the client request came in
    # Settled once the first leg leases a worker, from then on the lease counts the request.
    admission: Admission
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


def request_context(
    request: Request,
    request_id: str,
    body: dict[str, Any],
    chat: bool,
    lax_json: bool,
    admission: Admission,
    client_request_id: str | None = None,
) -> RequestContext:
    """The context of a request whose ``body`` was read and checked.

    ``lax_json`` says the body was read by the stdlib's JSON (``request_body.parse_json``). A
    sub-request of a batch has its own ``request_id`` and body; ``client_request_id`` is the
    client request's id, which its answer carries.
    """
    state: ProxyState = request.app.state.proxy
    # identity: bytes are relayed as they come, never decompressed and re-compressed.
    headers = {
        "Content-Type": "application/json",
        "Accept-Encoding": "identity",
        "X-Request-Id": request_id,
    }
    for name in _FORWARDED:
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    return RequestContext(
        state=state,
        # The route's own path, never the client's decoded one: a route pattern's "$" matches
        # before a trailing line feed, so "/v1/completions%0A" is routed here too.
        path=CHAT_PATH if chat else COMPLETIONS_PATH,
        chat=chat,
        request_id=request_id,
        legs=plan_legs(body, chat, lax_json),
        headers=MappingProxyType(headers),
        reply_headers=MappingProxyType({"X-Request-Id": client_request_id or request_id}),
        arrived=time.monotonic(),
        admission=admission,
        prompt=state.kv.prompt(body, chat) if state.kv is not None and state.kv_active else None,
    )
