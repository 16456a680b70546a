"""Prefill routing: consistent hashing of the prompt prefix with a bounded-load gate.

As SGLang's prefix hash: requests sharing a prompt prefix land on the same prefill worker and
hit its prefix cache; a worker over the load bound passes the request clockwise to the next
worker on the ring. The bound is "Consistent Hashing with Bounded Loads" (Mirrokni et al.) with
c = 1.25: a worker accepts while its in-flight count is below ceil(1.25 * (total + 1) / n),
which is the 1.25x-average gate that still admits work when every queue is empty.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

import numpy as np

from stages.routing.policies.select import (
    BOUNDED_LOAD_FACTOR,
    bounded_load_capacity,
    least_loaded_lowest,
)

PREFIX_BYTES = 1024
VIRTUAL_NODES = 160
LOAD_FACTOR = BOUNDED_LOAD_FACTOR


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class PrefillRouter:
    def __init__(
        self,
        urls: Sequence[str],
        virtual_nodes: int = VIRTUAL_NODES,
        load_factor: float = LOAD_FACTOR,
        prefix_bytes: int = PREFIX_BYTES,
    ) -> None:
        self.num_workers = len(urls)
        self.load_factor = load_factor
        self.prefix_bytes = prefix_bytes
        points = sorted(
            (_hash64(f"{url}#{v}".encode()), w)
            for w, url in enumerate(urls)
            for v in range(virtual_nodes)
        )
        # A list and bisect, not numpy: a numpy search of one value costs a few microseconds
        # of call overhead per request, bisect a fraction of one.
        self._ring = [h for h, _ in points]
        # For each ring position, the distinct workers met walking clockwise from it: the
        # fallback order is precomputed so a decision never walks the ring in Python.
        owners = [w for _, w in points]
        self._walk: list[tuple[int, ...]] = []
        n = len(owners)
        for start in range(n):
            seen: dict[int, None] = {}
            for step in range(n):
                seen.setdefault(owners[(start + step) % n])
                if len(seen) == self.num_workers:
                    break
            self._walk.append(tuple(seen))

    def home(self, key: bytes) -> int:
        """The worker owning ``key``'s prefix when every worker is free."""
        return self._walk[self._position(key)][0]

    def _position(self, key: bytes) -> int:
        return bisect.bisect_left(self._ring, _hash64(key[: self.prefix_bytes])) % len(self._ring)

    def choose(self, key: bytes, loads: np.ndarray, eligible: np.ndarray) -> int:
        capacity = bounded_load_capacity(loads, eligible, self.load_factor)
        for w in self._walk[self._position(key)]:
            if eligible[w] and loads[w] < capacity:
                return w
        # Unreachable with c > 1 (some worker is always below the bound); kept as a safe floor.
        return least_loaded_lowest(loads, eligible)
