"""Expert events: each KV block a worker stores, with what its tokens routed to.

Beside vLLM's KV events (which say which blocks a worker holds), a worker whose connector is
configured with ``publish_experts`` (an endpoint in ``kv_connector_extra_config``) publishes,
for every KV block that becomes full, the block's hash as vLLM's KV events carry it and its
expert counts (the message: ``stages.routing.kv.expert_messages``). A router then knows the
signature of every cached prefix before its request runs.

The transport is vLLM's own ``ZmqEventPublisher`` (PUB ``(topic, seq, payload)``, the last
batches replayed on a ROUTER socket), so a follower repairs gaps exactly as it does for KV
events (``stages.serve.proxy.view.kv_events``). It runs its own thread: the scheduler only
queues a batch.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from stages.routing.kv.expert_messages import BlockExperts, ExpertBatch

# kv_connector_extra_config key: the ZMQ endpoint a worker publishes its expert events on.
PUBLISH_EXPERTS_KEY = "publish_experts"
TOPIC = "eldr-experts"


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
