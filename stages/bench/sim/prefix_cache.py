"""A worker's prefix cache as the simulator models it: an LRU of KV blocks named by their
chained hashes (``workloads.blocks``), at a fixed capacity in blocks.

A prompt's hit is its leading run of cached blocks (a block is only usable after its whole
prefix), capped as vLLM caps it (the last prompt token is always computed). Blocks a running
request still uses are not pinned (vLLM's are): with a capacity far above the blocks in use at
once, as in a serving deployment, the difference is small.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from stages.bench.workloads.blocks import cacheable_blocks


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"cache capacity must be >= 1 block, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def cached_blocks(self, hashes: Sequence[int], prompt_tokens: int, block_size: int) -> int:
        """Leading blocks of a prompt (``hashes`` of its full blocks) this cache would serve;
        a look-up, not a use (the LRU order does not move)."""
        limit = min(len(hashes), cacheable_blocks(prompt_tokens, block_size))
        n = 0
        while n < limit and hashes[n] in self._blocks:
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """The blocks a request computed or used, now most recently used; the least recently
        used go when over capacity."""
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
            self.evicted += 1
