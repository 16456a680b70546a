"""Load shedding: a request that would wait behind too many others, or that comes while the
proxy drains, gets 503 at once, with ``Retry-After``, instead of joining an unbounded queue.

In flight means prefilling or decoding on a worker (the pools' leases): past the decode
workers' batch slots, a request waits in a vLLM scheduler queue, and ``max_queued`` bounds how
many may wait there. A request for several sequences (prompts, ``n``) counts as many: each
leases a worker of its own.
"""

from __future__ import annotations

from stages.serve.proxy.front.responses import ProxyError
from stages.serve.proxy.state import ProxyState

RETRY_AFTER_S = 1


class Shed(ProxyError):
    """A request refused before any work, with a 503 the client may retry (Retry-After)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(503, message, kind)


class Overloaded(Shed):
    def __init__(self, in_flight: int, limit: int, asked: int = 1) -> None:
        asks = f": this request asks for {asked}" if asked > 1 else ""
        super().__init__(f"the cluster is at capacity ({in_flight} in flight, at most"
                         f" {limit}{asks}): retry shortly", "overloaded")


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
    arriving together would all pass the check before any of them counted. A request split
    into several sequences takes a place for each (``reserve``): each leases a worker.
    """

    __slots__ = ("_counted", "_seats", "_state")

    def __init__(self, state: ProxyState) -> None:
        self._state = state
        self._counted = True
        self._seats: tuple[Admission, ...] = ()
        state.admitting += 1

    def reserve(self, sequences: int) -> list[Admission]:
        """A place for each of this request's ``sequences`` (its sub-requests, each settled
        by its own first lease), in place of its own; ``Overloaded`` when they would pass the
        admission limit, a 400 when they never could. ``settle`` lets go of them all."""
        state = self._state
        limit = state.config.admission_limit
        if limit is not None and self._counted:
            if sequences > limit:
                raise ProxyError(
                    400, f"this request asks for {sequences} sequences (prompts times n), and"
                    f" this proxy lets at most {limit} in flight at once: send them in smaller"
                    " requests", "bad_request")
            others = state.cluster_load() - 1
            if others + sequences > limit:
                raise Overloaded(others, limit, sequences)
        seats = tuple(Admission(state) for _ in range(sequences))
        self._seats = seats
        self._settle_own()
        return list(seats)

    def settle(self) -> None:
        """The request now counts through its lease, or is over (its sequences too, that took
        no lease yet); idempotent."""
        self._settle_own()
        for seat in self._seats:
            seat.settle()
        self._seats = ()

    def _settle_own(self) -> None:
        if self._counted:
            self._state.admitting -= 1
            self._counted = False


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
