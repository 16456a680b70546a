"""Load shedding: a request that would wait behind too many others, or that comes while the
proxy drains, gets 503 at once, with ``Retry-After``, instead of joining an unbounded queue.

In flight means prefilling or decoding on a worker (the pools' leases): past the decode
workers' batch slots, a request waits in a vLLM scheduler queue, and ``max_queued`` bounds how
many may wait there.
"""

from __future__ import annotations

from stages.serve.proxy.responses import ProxyError
from stages.serve.proxy.state import ProxyState

RETRY_AFTER_S = 1


class Shed(ProxyError):
    """A request refused before any work, with a 503 the client may retry (Retry-After)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(503, message, kind)


class Overloaded(Shed):
    def __init__(self, in_flight: int, limit: int) -> None:
        super().__init__(f"the cluster is at capacity ({in_flight} requests in flight, at most"
                         f" {limit}): retry shortly", "overloaded")


class Draining(Shed):
    def __init__(self) -> None:
        super().__init__("the proxy is stopping: send this request to another one, or retry"
                         " once it is back", "draining")


class ConnectionsExhausted(Shed):
    """Every upstream connection of this proxy was in use until the request gave up waiting:
    the proxy's own limit, reported as its own (no worker is blamed)."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"the proxy has no free connection to its workers ({detail}): retry"
                         " shortly", "proxy_connections_exhausted")


class Admission:
    """A request let in that holds no worker lease yet.

    It counts in ``ProxyState.cluster_load`` from the check until its first lease is taken (or
    it ends without one). Leases are taken only after the body is read, so without it a burst
    arriving together would all pass the check before any of them counted.
    """

    __slots__ = ("_state",)

    def __init__(self, state: ProxyState) -> None:
        self._state: ProxyState | None = state
        state.admitting += 1

    def settle(self) -> None:
        """The request now counts through its lease, or is over; idempotent."""
        if self._state is not None:
            self._state.admitting -= 1
            self._state = None


def admit(state: ProxyState) -> Admission:
    """Let a request in, or raise ``Overloaded`` when it would exceed the admission limit,
    ``Draining`` once the proxy is stopping."""
    if state.draining:
        raise Draining()
    limit = state.config.admission_limit
    if limit is not None:
        in_flight = state.cluster_load()
        if in_flight >= limit:
            raise Overloaded(in_flight, limit)
    return Admission(state)
