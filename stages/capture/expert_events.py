"""Expert events: each KV block a worker stores, with what its tokens routed to.

Beside vLLM's KV events (which say which blocks a worker holds), a worker whose connector is
configured with ``publish_experts`` (an endpoint in ``kv_connector_extra_config``) publishes,
for every KV block that becomes full, the block's hash as vLLM's KV events carry it (the int
form, ``external_hash``) and its expert counts: ``[l, e]`` = tokens of that block whose top-k
picked expert ``e`` in MoE layer ``l`` (a signature's units; a prompt's signature is the sum of
its blocks'). A router then knows the signature of every cached prefix before its request runs.

The transport is vLLM's own ``ZmqEventPublisher`` (PUB ``(topic, seq, payload)``, the last
batches replayed on a ROUTER socket), so a follower repairs gaps exactly as it does for KV
events (``stages.serve.proxy.kv_events``). It runs its own thread: the scheduler only queues
a batch. Counts travel as ``uint8`` (one token picks an expert at most once per layer, so a
count never exceeds the block size) or ``uint16`` for blocks over 255 tokens: 6 KiB per block
for a Qwen3-30B-A3B-shaped model (48 MoE layers x 128 experts).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

# kv_connector_extra_config key: the ZMQ endpoint a worker publishes its expert events on.
PUBLISH_EXPERTS_KEY = "publish_experts"
TOPIC = "eldr-experts"


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


class ExpertEventPublisher:
    """A worker's expert events (scheduler process), through vLLM's ``ZmqEventPublisher``."""

    # A batch is one step's new blocks: up to a long prefill chunk's worth (8,192 tokens in
    # blocks of 16 are 3 MiB of counts on a Qwen3-30B-shaped model), so the replay buffer and
    # each subscriber's send queue keep far fewer batches than vLLM's KV events do (10,000 and
    # 100,000). A gap past the buffer only leaves blocks unknown to the proxy that missed it.
    REPLAY_BATCHES = 128
    QUEUED_BATCHES = 1_000

    def __init__(self, endpoint: str) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        from stages.routing.kv.endpoints import replay_endpoint

        self.endpoint = endpoint
        self._publisher = ZmqEventPublisher(
            0, endpoint=endpoint, replay_endpoint=replay_endpoint(endpoint), topic=TOPIC,
            buffer_steps=self.REPLAY_BATCHES, hwm=self.QUEUED_BATCHES)

    def publish(self, blocks: dict[int, np.ndarray]) -> None:
        """Queue one batch (hash -> ``[L, E]`` counts); the publisher's thread sends it."""
        if not blocks:
            return
        events: list[Any] = [BlockExperts.of(h, counts) for h, counts in blocks.items()]
        self._publisher.publish(ExpertBatch(time.time(), events))

    def close(self) -> None:
        self._publisher.shutdown()
