"""Per decode worker, the expected distinct experts of one step of the requests it runs now.

Each in-flight request contributes its predicted per-step inclusion probabilities ``pi``
(``stages.signature.inclusion``, from its prefill counts) as ``log(1 - pi)``; a worker keeps
their sum ``S``, so ``q = exp(S)`` is the chance an expert is missed by all its requests, and a
step is expected to activate ``sum(1 - q)`` distinct experts (the simulator's Poisson-binomial
union). A request joining adds ``q @ pi`` of them. Dispatch and completion touch one worker's
row (O(L x E)); a question about every worker is one matrix-vector product.
"""

from __future__ import annotations

import numpy as np


class WorkerExpertLoad:
    def __init__(self, num_workers: int, size: int) -> None:
        """``size`` = L*E, the flattened signature."""
        self.size = size
        self._log_miss = np.zeros((num_workers, size), dtype=np.float64)
        # float32 copy of exp(S) for the per-decision product: half the memory traffic, and
        # the product's relative error (~1e-6) is far below what separates two workers.
        self._miss = np.ones((num_workers, size), dtype=np.float32)
        self._members = np.zeros(num_workers, dtype=np.int64)
        self.distinct = np.zeros(num_workers, dtype=np.float64)  # expected distinct, per worker

    def add(self, worker: int, log_complement: np.ndarray) -> None:
        self._log_miss[worker] += log_complement
        self._members[worker] += 1
        self._refresh(worker)

    def remove(self, worker: int, log_complement: np.ndarray) -> None:
        self._members[worker] -= 1
        if self._members[worker] == 0:
            # Start clean: no rounding residue carried from one busy period to the next.
            self._log_miss[worker].fill(0.0)
        else:
            self._log_miss[worker] -= log_complement
        self._refresh(worker)

    def members(self, worker: int) -> int:
        return int(self._members[worker])

    def added_distinct(self, pi: np.ndarray) -> np.ndarray:
        """Per worker, the expected distinct experts a request with flattened ``pi`` adds."""
        return self._miss @ pi

    def _refresh(self, worker: int) -> None:
        miss = np.exp(self._log_miss[worker])
        self._miss[worker] = miss
        self.distinct[worker] = self.size - float(miss.sum())
