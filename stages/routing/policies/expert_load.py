"""Per decode worker, the expected distinct experts of one step of the requests it runs now.

Each in-flight request contributes its predicted per-step inclusion probabilities ``pi``
(``stages.signature.inclusion``, from its prefill counts) as ``log(1 - pi)``; a worker keeps
their sum ``S``, so ``q = exp(S)`` is the chance an expert is missed by all its requests, and a
step is expected to activate ``sum(1 - q)`` distinct experts (the simulator's Poisson-binomial
union). A request joining adds ``q @ pi`` of them. A question about every worker is one
matrix-vector product.

Dispatch is on the routing path, completion is not: a dispatch only multiplies the worker's
``q`` by ``1 - pi`` and queues ``pi``; the logs and the exact ``q = exp(S)`` are computed when
one of the worker's requests completes (O(L x E) per queued request), so rounding never
accumulates past the next completion, and a ``q`` that underflows on the way (it means "surely
active") is rebuilt exactly then.

``q`` never goes below ``MISS_FLOOR``: a few requests that all surely use an expert multiply
its ``q`` into float32's subnormal range, where x86 arithmetic runs about 10x slower (measured:
the per-decision product went from ~55 us to ~560 us with a third of ``q`` subnormal). A miss
chance of 1e-30 instead of less changes no expected count.
"""

from __future__ import annotations

import numpy as np

from stages.routing.policies import union_kernels
from stages.routing.policies.union_kernels import MISS_FLOOR


class WorkerExpertLoad:
    def __init__(self, num_workers: int, size: int) -> None:
        """``size`` = L*E, the flattened signature."""
        self.size = size
        self._log_miss = np.zeros((num_workers, size), dtype=np.float64)
        # float32 q (``miss``) for the per-decision product: half the memory traffic, and its
        # relative error (~1e-7) is far below what separates two workers.
        self.miss = np.ones((num_workers, size), dtype=np.float32)
        self._members = np.zeros(num_workers, dtype=np.int64)
        self._queued: list[list[np.ndarray]] = [[] for _ in range(num_workers)]
        self.distinct = np.zeros(num_workers, dtype=np.float64)  # expected distinct, per worker
        self._term = np.empty(size, dtype=np.float32)
        self._exact = np.empty(size, dtype=np.float64)

    def add(self, worker: int, pi: np.ndarray, added: float | None = None) -> None:
        """A request with flattened float32 ``pi`` joined ``worker``; ``added`` is
        ``miss[worker] @ pi`` when the caller has it (it is the rise in distinct)."""
        miss = self.miss[worker]
        if added is None:
            added = float(miss @ pi)
        union_kernels.join(miss, pi)
        self._members[worker] += 1
        self._queued[worker].append(pi)
        self.distinct[worker] += added

    def remove(self, worker: int, pi: np.ndarray) -> None:
        """A request that joined ``worker`` with ``pi`` (the same array) left it."""
        queued = self._queued[worker]
        self._members[worker] -= 1
        log_miss = self._log_miss[worker]
        if self._members[worker] == 0:
            # Start clean: no rounding residue carried from one busy period to the next.
            log_miss.fill(0.0)
            queued.clear()
        else:
            term = self._term  # scratch, so the loop allocates nothing
            for joined in queued:
                np.log1p(np.negative(joined, out=term), out=term)
                log_miss += term
            queued.clear()
            np.log1p(np.negative(pi, out=term), out=term)
            log_miss -= term
        exact = np.exp(log_miss, out=self._exact)
        self.distinct[worker] = self.size - float(exact.sum())
        np.maximum(exact, MISS_FLOOR, out=self.miss[worker])

