"""Expert events on the wire: what a worker publishes for each KV block it stores (its hash as
vLLM's KV events carry it, the int form ``external_hash``, and its expert counts) and what a
router reads back (``stages.routing.kv.block_experts``); the publisher is
``stages.capture.expert_events``.

A block's counts are ``[l, e]`` = tokens of that block whose top-k picked expert ``e`` in MoE
layer ``l`` (a signature's units; a prompt's signature is the sum of its blocks'). Counts
travel as ``uint8`` (one token picks an expert at most once per layer, so a count never exceeds
the block size) or ``uint16`` for blocks over 255 tokens: 6 KiB per block for a
Qwen3-30B-A3B-shaped model (48 MoE layers x 128 experts).
"""

from __future__ import annotations

import msgspec
import numpy as np


class BlockExperts(msgspec.Struct, array_like=True, tag=True, gc=False):
    """One stored block: its external hash and its counts, ``layers x experts`` little-endian
    unsigned integers of ``len(counts) // (layers * experts)`` bytes each, row-major."""

    block_hash: int
    layers: int
    experts: int
    counts: bytes

    @classmethod
    def of(cls, block_hash: int, counts: np.ndarray) -> BlockExperts:
        dtype = "<u1" if int(counts.max(initial=0)) <= 0xFF else "<u2"
        layers, experts = counts.shape
        return cls(block_hash, int(layers), int(experts), counts.astype(dtype).tobytes())

    def table(self) -> np.ndarray:
        """The counts ``[L, E]`` as they travel (uint8 or uint16, read-only); raises
        ValueError when they do not fit the shape."""
        cells = self.layers * self.experts
        if cells <= 0 or len(self.counts) not in (cells, 2 * cells):
            raise ValueError(f"block {self.block_hash}: {len(self.counts)} bytes of counts for"
                             f" {self.layers} x {self.experts}")
        dtype = "<u1" if len(self.counts) == cells else "<u2"
        return np.frombuffer(self.counts, dtype=dtype).reshape(self.layers, self.experts)


class ExpertBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch as vLLM's ``EventBatch`` frames it: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[BlockExperts]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(ExpertBatch)


def decode_batch(payload: bytes) -> ExpertBatch:
    """Raises msgspec.DecodeError on anything but an expert batch."""
    return _DECODER.decode(payload)
