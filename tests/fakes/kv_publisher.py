"""vLLM's KV events from a fake worker: what ``ZmqEventPublisher`` sends, for the prompts the
fake ran.

A ZMQ PUB socket sends ``(topic, seq, msgpack batch)`` (a batch is ``[ts, events, dp_rank]``,
each event a tagged map as vLLM's ``BlockStored`` / ``BlockRemoved``), and a ROUTER socket on
eldr's replay endpoint (``stages.routing.kv.endpoints.replay_endpoint``) answers a replay
request with the buffered batches from the asked number, then the end marker, as vLLM's does.

The fake's cache behaves as vLLM's prefix cache does, minus its LRU detail: a prompt it runs
stores the full blocks it does not hold yet (one batch), and past ``capacity`` blocks the
oldest are removed in the same batch. The blocks' hashes are either the real ones (``model``
given: the model's tokenizer and vLLM's sha256 hashing, computed once per prompt text, so the
proxy's view matches them) or stand-ins derived from the prompt text (``model`` None: about
``len(text) / chars_per_token`` tokens' worth of blocks, never matching what the proxy
computes). The stand-ins are for prompts that never repeat (single-turn traffic): tokenizing
each one would cost the fake about a millisecond per 2,000 tokens, on the cores the router
under test needs, while the proxy's view only needs the block size and a steady stream of
valid events to stay trusted and to do its work.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from stages.routing.kv.block_hashes import BlockHasher
from stages.routing.kv.endpoints import replay_endpoint
from stages.routing.kv.prompt_tokens import PromptTokenizer

END_SEQ = (-1).to_bytes(8, "big", signed=True)
CPU_BLOCK_SIZE = 128  # vLLM's block size on CPU workers (the bundled model's serve runs)
_HASHES_MAX = 4096  # prompt texts whose hashes are kept; cleared when full
_LOW_64 = (1 << 64) - 1
_ODD = 0x9E3779B97F4A7C15  # steps the stand-in hashes of one text apart


class FakeKVPublisher:
    """Publishes a fake worker's stored blocks on ``endpoint`` (``tcp://HOST:PORT``, replay on
    PORT + 1). ``model``: the tokenizer's directory or hub id. Sends from the caller's thread;
    replays are answered from a thread of its own."""

    def __init__(self, endpoint: str, model: str | None, block_size: int = CPU_BLOCK_SIZE,
                 capacity: int = 4096, chars_per_token: float = 4.0, topic: str = "kv",
                 buffer: int = 10_000, head_model: str | None = None,
                 step_s: float = 0.0) -> None:
        """``head_model``: with stand-in hashes (``model`` None), a tokenizer that encodes
        only a prompt's head, for the first block's token ids vLLM's events carry.
        ``step_s``: publish the events of the prompts run within one engine step as one
        batch, as vLLM's scheduler does after each step (``ran`` is then called from an
        event loop, which sends the batch); 0: one batch per prompt."""
        self.step_s = step_s
        self._step: list[dict[str, Any]] = []  # this step's events, not sent yet
        self.block_size = block_size
        self.heads = None if head_model is None else PromptTokenizer(head_model)
        self.capacity = capacity
        self.chars_per_token = chars_per_token
        self.tokenizer = None if model is None else PromptTokenizer(model)
        self.hasher = BlockHasher("sha256")
        self._held: dict[int, None] = {}  # the blocks held, oldest first
        self._hashes: dict[tuple[bool, str], tuple[list[int], list[int]]] = {}
        self._topic = topic.encode()
        self._encode = msgspec.msgpack.Encoder().encode
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._lock = threading.Lock()  # the buffer, between sends and the replay thread
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay = self._context.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.bind(replay_endpoint(endpoint))
        self._running = True
        self._thread = threading.Thread(target=self._serve_replays, daemon=True,
                                        name="fake-kv-replay")
        self._thread.start()
        self.published = 0

    def hashes(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The full blocks' hashes of ``body``'s prompt, as the worker computes them."""
        return self._blocks(body, chat)[0]

    def _blocks(self, body: dict[str, Any], chat: bool) -> tuple[list[int], list[int]]:
        """The prompt's full blocks' hashes and its token ids (none with stand-in hashes)."""
        key = (chat, prompt_key(body))
        if self.tokenizer is None:
            return stand_in_hashes(key[1], self.block_size, self.chars_per_token), []
        found = self._hashes.get(key)
        if found is None:
            ids = self.tokenizer.chat(body) if chat else self.tokenizer.completion(body)
            ids = ids or []
            found = (self.hasher.hashes(ids, self.block_size), ids)
            if len(self._hashes) >= _HASHES_MAX:
                self._hashes.clear()
            self._hashes[key] = found
        return found

    def ran(self, body: dict[str, Any], chat: bool) -> None:
        """The worker ran ``body``'s prompt: it stored the full blocks it lacked, from the
        first of them on, as vLLM's event tells (their parent, their token ids)."""
        held = self._held
        hashes, ids = self._blocks(body, chat)
        first = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
        new = hashes[first:]
        if not new:
            return
        for h in new:
            held[h] = None
        evicted = list(itertools.islice(held, max(0, len(held) - self.capacity)))
        for h in evicted:
            del held[h]
        size = self.block_size
        if not ids and first == 0 and self.heads is not None:
            # Stand-in hashes: the first block's ids alone, from the prompt's head (vLLM's
            # event carries every new block's; the proxy reads only a first block's).
            rendered = self.heads.render(body, chat)
            if rendered is not None:
                ids = self.heads.head_ids(rendered, 8 * size)[:size]
        events = [{"type": "BlockStored", "block_hashes": new,
                   "parent_block_hash": hashes[first - 1] if first else None,
                   "token_ids": ids[first * size:len(hashes) * size], "block_size": size,
                   "lora_id": None, "medium": "GPU", "lora_name": None}]
        if evicted:
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"})
        if self.step_s <= 0:
            self.send(events)
            return
        if not self._step:
            asyncio.get_running_loop().call_later(self.step_s, self._end_step)
        self._step.extend(events)

    def _end_step(self) -> None:
        events, self._step = self._step, []
        self.send(events)

    def send(self, events: list[dict[str, Any]]) -> None:
        """One batch of ``events``, numbered next."""
        payload = self._encode([time.time(), events, None])
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        # PUB never blocks: past its high-water mark a subscriber loses messages and asks
        # for a replay, as it would from vLLM.
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self.published += 1

    def _serve_replays(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while self._running:
            if not poller.poll(100):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM ignores a malformed request too
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= first]
            for seq, payload in batches:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._running = False
        self._thread.join()
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._context.term()


def stand_in_hashes(text: str, block_size: int, chars_per_token: float) -> list[int]:
    """Distinct 64-bit numbers, one per full block ``text`` would fill at ``chars_per_token``;
    a text's are the same each time and in every process, as vLLM's are on every worker (a
    prompt's prefill and decode workers store the same blocks)."""
    blocks = int(len(text) / chars_per_token) // block_size
    base = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return [(base + i * _ODD) & _LOW_64 for i in range(blocks)]


def prompt_key(body: dict[str, Any]) -> str:
    """What of a request decides its prompt's tokens, as a hashable key."""
    return repr((body.get("prompt"), body.get("messages"), body.get("add_special_tokens")))
