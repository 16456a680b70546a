"""What each cached KV block's tokens routed to, as the workers' expert events tell: block hash
-> ``[L, E]`` counts, so the signature of a prompt's cached prefix is known before it runs.

A block hash names its tokens and every token before them, so its counts are the same on
every worker of one model: one index serves every pool and every worker, and a worker that
restarts or loses messages leaves nothing wrong behind (a block nobody holds any more only
waits for the bound). Memory is bounded by least-recent use (``max_blocks``; a prompt's match
refreshes its blocks). Counts are kept as they travel, one byte each (two for blocks over 255
tokens): 6 KiB per block for a Qwen3-30B-A3B-shaped model, so the default bound is about
300 MiB there.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import numpy as np

from stages.errors import EldrError
from stages.routing.kv.expert_messages import decode_batch

log = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS = 50_000
# As the KV event follower (stages.serve.proxy.view.kv_events): a seq this far behind the last one
# is a restarted publisher's, not a late duplicate.
RESTART_DISTANCE = 20_000


class BlockExperts:
    """Block hash -> its counts (``[L, E]``, uint8 or uint16), least recently used evicted
    first."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise EldrError(f"the expert index needs room for at least one block, got"
                            f" {max_blocks}")
        self.max_blocks = max_blocks
        self.shape: tuple[int, int] | None = None  # (L, E), from the first block
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def stored(self, block_hash: int, counts: np.ndarray) -> None:
        if self.shape is None:
            self.shape = (int(counts.shape[0]), int(counts.shape[1]))
        elif counts.shape != self.shape:
            raise ValueError(f"block {block_hash} has counts of shape {counts.shape}, the"
                             f" index holds {self.shape}")
        self._blocks[block_hash] = counts
        self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.evicted += 1

    def leading(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, the index knows in a row."""
        known = 0
        for h in hashes:
            if h not in self._blocks:
                break
            known += 1
        return known

    def signature_of(self, hashes: Sequence[int]) -> np.ndarray | None:
        """int32 ``[L, E]``: the counts of the prompt's leading known blocks summed (the
        signature of its cached prefix); None when the first block is unknown."""
        known = self.leading(hashes)
        if known == 0:
            return None
        total = np.zeros(self.shape or (0, 0), dtype=np.int32)
        for h in hashes[:known]:
            self._blocks.move_to_end(h)
            total += self._blocks[h]
        return total


class ExpertEventsView:
    """Feeds one :class:`BlockExperts` from the expert events of ``num_workers`` workers; the
    follower of ``stages.serve.proxy.view.kv_events`` drives it as it drives a KV view
    (``receive``, ``latest_seq``, ``flush``, ``apply``, ``gap``, ``malformed``), with the same
    replay of missed batches."""

    def __init__(self, num_workers: int, index: BlockExperts) -> None:
        self.index = index
        self.last_seq: list[int | None] = [None] * num_workers
        self.replied = [False] * num_workers  # as ``KVView.replied``
        self.batches = np.zeros(num_workers, dtype=np.int64)
        self.gaps = np.zeros(num_workers, dtype=np.int64)
        self.lost = np.zeros(num_workers, dtype=np.int64)  # gaps no replay repaired
        self.undecodable = np.zeros(num_workers, dtype=np.int64)

    def apply(self, worker: int, seq: int, payload: bytes) -> None:
        last = self.last_seq[worker]
        # Already applied (the replay and the stream overlap), unless the numbers started
        # over: a 0 after a later number is a restarted publisher's first batch. (A publisher
        # that restarts after one batch loses its new first one here: those blocks stay
        # unknown, nothing is wrong.)
        if (last is not None and last - RESTART_DISTANCE < seq <= last
                and (seq != 0 or last == 0)):
            return
        try:
            batch = decode_batch(payload)
            tables = [(event.block_hash, event.table()) for event in batch.events]
            for block_hash, counts in tables:
                self.index.stored(block_hash, counts)
        except (msgspec.DecodeError, ValueError) as exc:
            self.malformed(worker, repr(exc))
            return
        self.last_seq[worker] = seq
        self.batches[worker] += 1

    def receive(self, worker: int, seq: int, payload: bytes) -> None:
        """A batch from the stream, applied as it comes: the KV view defers its batches off
        the requests' path, but these are few (a block's counts once, when first stored)."""
        self.apply(worker, seq, payload)

    def latest_seq(self, worker: int) -> int | None:
        return self.last_seq[worker]

    def flush(self) -> None:
        """Nothing is held back (``receive``)."""

    def gap(self, worker: int, repaired: bool) -> None:
        # Nothing to clear: counts of a hash stay true. Missed blocks are only unknown.
        self.gaps[worker] += 1
        if not repaired:
            self.lost[worker] += 1

    def malformed(self, worker: int, why: str) -> None:
        self.undecodable[worker] += 1
        log.warning("worker %d sent an undecodable expert event message: %s", worker, why)

    def state(self) -> dict[str, object]:
        return {"blocks": len(self.index), "evicted": self.index.evicted,
                "batches": self.batches.tolist(), "gaps": self.gaps.tolist(),
                "lost": self.lost.tolist(), "undecodable": self.undecodable.tolist()}
