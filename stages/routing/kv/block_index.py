"""Which worker of a pool holds which KV block, as its KV events tell, and how much of a prompt
each one already has.

vLLM's prefix cache matches a prompt block by block from its start and stops at the first block
it lacks, so what a worker can reuse is the run of leading blocks it holds. Each block hash maps
to a bit mask of its holders, so one pass over a prompt's hashes answers for every worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from stages.errors import EldrError


class BlockIndex:
    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise EldrError(f"need at least one worker, got {num_workers}")
        self.num_workers = num_workers
        self._holders: dict[int, int] = {}  # block hash -> bit mask of the workers holding it
        self._blocks: list[set[int]] = [set() for _ in range(num_workers)]

    def stored(self, worker: int, hashes: Iterable[int]) -> None:
        bit = 1 << worker
        mine = self._blocks[worker]
        holders = self._holders
        for h in hashes:
            holders[h] = holders.get(h, 0) | bit
            mine.add(h)

    def removed(self, worker: int, hashes: Iterable[int]) -> None:
        keep = ~(1 << worker)
        mine = self._blocks[worker]
        holders = self._holders
        for h in hashes:
            if h not in mine:
                continue  # a block stored before this proxy listened, or removed twice
            mine.discard(h)
            left = holders[h] & keep
            if left:
                holders[h] = left
            else:
                del holders[h]

    def cleared(self, worker: int) -> None:
        self.removed(worker, list(self._blocks[worker]))

    def held_anywhere(self, block_hash: int) -> bool:
        return block_hash in self._holders

    def held(self, worker: int) -> int:
        return len(self._blocks[worker])

    def leading_blocks(self, hashes: Sequence[int]) -> np.ndarray:
        """int64 [W]: how many of ``hashes``, from the first, each worker holds in a row."""
        counts = np.zeros(self.num_workers, dtype=np.int64)
        alive = (1 << self.num_workers) - 1
        holders = self._holders
        run = 0
        for h in hashes:
            now = alive & holders.get(h, 0)
            if now != alive:
                # Workers whose run ends here: visited once each, not once per block.
                _set_bits(counts, alive & ~now, run)
                alive = now
                if not alive:
                    return counts
            run += 1
        _set_bits(counts, alive, run)
        return counts

    def holds_all(self, worker: int, hashes: Iterable[int]) -> bool:
        bit = 1 << worker
        holders = self._holders
        return all(holders.get(h, 0) & bit for h in hashes)


def _set_bits(counts: np.ndarray, mask: int, value: int) -> None:
    """``counts[w] = value`` for every bit ``w`` set in ``mask``."""
    w = 0
    while mask:
        if mask & 1:
            counts[w] = value
        mask >>= 1
        w += 1
