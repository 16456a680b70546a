"""Several routing proxies in front of the same decode workers, each on its own view of them.

A deployment runs N proxy processes. A proxy knows its own dispatches and completions at once,
and the others' only once the decode workers publish their running batches: here a constant
``publish_delay_s`` later (a worker publishing every P ms plus transport is a delay between 0
and P, plus a little; the constant is its worst case, or its mean when set to P/2). Each proxy
has its own policy instance, told of its own requests when they happen and of the others' when
they are published, and its own in-flight counts, which its policy routes on. The decode
workers themselves run exactly what was sent to them: the simulator's true loads stay exact.

The simulator owns the clock: it asks ``ProxyViews`` which proxy takes a request, builds the
request from that proxy's view, and delivers each publication (``publish``) when it is due.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stages.routing.policies import DecodePolicy, RoutingRequest

DISPATCHED, COMPLETED = 0, 1


def proxy_seeds(seed: int, proxies: int) -> list[int]:
    """Each proxy's policy seed: the first keeps ``seed`` (so proxy 0 draws what a lone proxy
    would), the others are derived from it, distinct per proxy and the same on every run."""
    derived = np.random.SeedSequence(seed).spawn(proxies - 1)
    return [seed, *(int(s.generate_state(1)[0]) for s in derived)]


class ProxyViews:
    """The proxies' policies and in-flight counts; one proxy per request, by arrival order."""

    def __init__(self, policies: Sequence[DecodePolicy], num_decode: int) -> None:
        if len(policies) < 2:
            raise ValueError("ProxyViews models two or more proxies; one needs no views")
        self.policies = list(policies)
        self.loads = [np.zeros(num_decode, dtype=np.int64) for _ in policies]
        # Dispatched, not yet published: the request the other proxies' policies will be told.
        self.unpublished: dict[int, RoutingRequest] = {}

    def proxy_of(self, request: int) -> int:
        # Round robin by arrival order: what the kernel's SO_REUSEPORT spread of connections
        # over N processes listening on one port approximates (it hashes each connection, so
        # it is even in aggregate, not in strict turn).
        return request % len(self.policies)

    def dispatch(self, proxy: int, worker: int, key: int, request: RoutingRequest) -> None:
        """``proxy`` sent request ``key`` to ``worker``: it knows at once."""
        self.policies[proxy].on_dispatch(worker, request, key)
        self.loads[proxy][worker] += 1
        self.unpublished[key] = request

    def complete(self, proxy: int, worker: int, key: int) -> None:
        """Request ``key`` ended on ``worker``: the proxy that streams it knows at once."""
        self._drop(proxy, worker, key)

    def publish(self, what: int, worker: int, key: int) -> None:
        """The decode workers' published state now shows ``key`` dispatched to (or completed
        on) ``worker``: every proxy but its own hears of it."""
        owner = self.proxy_of(key)
        others = [p for p in range(len(self.policies)) if p != owner]
        if what == DISPATCHED:
            request = self.unpublished.pop(key)
            for p in others:
                self.policies[p].on_dispatch(worker, request, key)
                self.loads[p][worker] += 1
            return
        if key in self.unpublished:
            # Both are published after the same delay and the event heap keeps their order,
            # so this is a simulator bug, not a state a proxy could be in.
            raise AssertionError(f"request {key} published as completed before as dispatched")
        for p in others:
            self._drop(p, worker, key)

    def _drop(self, proxy: int, worker: int, key: int) -> None:
        loads = self.loads[proxy]
        if loads[worker] <= 0:
            raise AssertionError(f"proxy {proxy} would count {loads[worker] - 1} requests"
                                 f" on worker {worker} after request {key}")
        loads[worker] -= 1
        self.policies[proxy].on_complete(worker, key)
