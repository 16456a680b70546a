"""Which worker of a pool holds which KV block, as its KV events tell, and how much of a prompt
each one already has.

vLLM's prefix cache matches a prompt block by block from its start and stops at the first block
it lacks, so what a worker can reuse is the run of leading blocks it holds. Each worker's blocks
are one set: an event's blocks are added or dropped in one C call (every request the workers
run stores and evicts a prompt's worth, where a request's match reads a few).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import takewhile

import numpy as np

from stages.errors import EldrError


class BlockIndex:
    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise EldrError(f"need at least one worker, got {num_workers}")
        self.num_workers = num_workers
        self._blocks: list[set[int]] = [set() for _ in range(num_workers)]

    def stored(self, worker: int, hashes: Iterable[int]) -> None:
        self._blocks[worker].update(hashes)

    def removed(self, worker: int, hashes: Iterable[int]) -> None:
        # A block stored before this proxy listened, or removed twice, is not there: ignored.
        self._blocks[worker].difference_update(hashes)

    def cleared(self, worker: int) -> None:
        self._blocks[worker].clear()

    def held_anywhere(self, block_hash: int) -> bool:
        return any(block_hash in mine for mine in self._blocks)

    def held(self, worker: int) -> int:
        return len(self._blocks[worker])

    def leading_blocks(self, hashes: Sequence[int]) -> np.ndarray:
        """int64 [W]: how many of ``hashes``, from the first, each worker holds in a row."""
        counts = np.zeros(self.num_workers, dtype=np.int64)
        if not hashes:
            return counts
        first = hashes[0]
        for w, mine in enumerate(self._blocks):
            if first in mine:  # most workers lack a prompt's first block: no run to count
                counts[w] = len(list(takewhile(mine.__contains__, hashes)))
        return counts

    def holds_all(self, worker: int, hashes: Iterable[int]) -> bool:
        return self._blocks[worker].issuperset(hashes)
