"""Load shedding: a request that would wait behind too many others gets 503 at once, with
``Retry-After``, instead of joining an unbounded queue.

In flight means prefilling or decoding on a worker (the pools' leases): past the decode
workers' batch slots, a request waits in a vLLM scheduler queue, and ``max_queued`` bounds how
many may wait there.
"""

from __future__ import annotations

from stages.serve.proxy.responses import ProxyError
from stages.serve.proxy.state import ProxyState

RETRY_AFTER_S = 1


class Overloaded(ProxyError):
    def __init__(self, in_flight: int, limit: int) -> None:
        super().__init__(
            503, f"the cluster is at capacity ({in_flight} requests in flight, at most {limit}):"
            " retry shortly", "overloaded",
        )


def admit(state: ProxyState) -> None:
    """Raise ``Overloaded`` when a new request would exceed the admission limit."""
    limit = state.config.admission_limit
    if limit is None:
        return
    in_flight = int(state.decode.loads().sum() + state.prefill.loads().sum())
    if in_flight >= limit:
        raise Overloaded(in_flight, limit)
