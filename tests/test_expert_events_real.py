"""Expert events against one real compiled vLLM worker on the bundled tiny model: the per-block
expert counts it publishes for a prompt, summed, equal the signature its prefill records.

What is comparable: a signature covers every prompt token, its partial last block included,
while expert events carry only full blocks (vLLM caches and hashes nothing else). So a prompt
of whole blocks must match exactly, a cold one and one whose leading blocks are prefix-cache
hits (their counts were published by the request that computed them); a prompt ending
mid-block must exceed its full blocks' sum by exactly its partial block: non-negative counts,
``tail tokens x top-k`` per MoE layer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq

from stages.routing.kv.block_experts import BlockExperts, ExpertEventsView
from stages.routing.kv.block_hashes import BlockHasher
from stages.routing.kv.endpoints import replay_endpoint
from stages.serve.proxy.view.kv_events import END_SEQ
from stages.signature import wire
from tests.conftest import free_port, requires_vllm, wait_ready

pytestmark = [requires_vllm, pytest.mark.vllm]

BLOCK = 32


def _replay_all(endpoint: str, view: ExpertEventsView) -> None:
    """Every batch the worker's replay socket still holds, into ``view``."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(replay_endpoint(endpoint))
    try:
        socket.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            assert socket.poll(10_000), "no answer from the expert events' replay socket"
            _, _, seq, payload = socket.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == END_SEQ:
                return
            view.apply(0, int.from_bytes(seq, "big"), payload)
    finally:
        socket.close(linger=0)


def test_published_block_counts_sum_to_the_prefill_signature(
    tiny_model: Path, tmp_path: Path
) -> None:
    from stages.engine import ServerSpec, VllmServer

    endpoint = f"ipc://{tmp_path}/experts"
    spec = ServerSpec(
        model=str(tiny_model), port=free_port(), role="plain", served_name="tiny",
        expert_events=endpoint,
        extra_args=("--enable-prompt-tokens-details", "--block-size", str(BLOCK)),
    )
    top_k = json.loads((tiny_model / "config.json").read_text())["num_experts_per_tok"]
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    tokens = [int(t) for t in np.random.default_rng(7).integers(10, vocab - 10, size=200)]
    hasher = BlockHasher("sha256")
    index = BlockExperts()
    view = ExpertEventsView(1, index)
    server = VllmServer(spec, tmp_path / "logs")
    try:
        wait_ready(server, timeout_s=900)

        def prefill(prompt: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
            """(signature, published full-block sum, cached tokens)"""
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
            response.raise_for_status()
            payload = response.json()
            signature = wire.decode(payload["kv_transfer_params"])
            assert signature is not None
            hashes = hasher.hashes(prompt, BLOCK)
            deadline = time.monotonic() + 10
            while True:  # the publisher's thread sends shortly after the step
                _replay_all(endpoint, view)
                if index.leading(hashes) == len(hashes) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert index.leading(hashes) == len(hashes), "a full block's counts never came"
            summed = index.signature_of(hashes)
            assert summed is not None
            details = (payload.get("usage") or {}).get("prompt_tokens_details") or {}
            return signature, summed, int(details.get("cached_tokens") or 0)

        whole = tokens[: 3 * BLOCK]
        signature, summed, cached = prefill(whole)  # cold
        assert cached == 0
        np.testing.assert_array_equal(summed, signature)
        assert (summed.sum(axis=1) == len(whole) * top_k).all()

        longer = tokens[: 5 * BLOCK]  # its first three blocks are prefix-cache hits
        signature, summed, cached = prefill(longer)
        assert cached == 3 * BLOCK
        np.testing.assert_array_equal(summed, signature)

        signature, summed, cached = prefill(whole)  # a full hit: vLLM recomputes one token
        assert cached > 0
        np.testing.assert_array_equal(summed, signature)

        tail = 8
        mid_block = tokens[: 4 * BLOCK + tail]  # four cached full blocks and a partial one
        signature, summed, cached = prefill(mid_block)
        assert cached == 4 * BLOCK
        partial = signature - summed
        assert (partial >= 0).all()
        assert (partial.sum(axis=1) == tail * top_k).all()
        assert view.undecodable.sum() == 0
    finally:
        server.stop()
