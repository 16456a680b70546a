"""What KV-cache-aware routing knows in one proxy: each pool's view of its workers' caches,
and a request's prompt as the block hashes those workers compute for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from stages.routing.kv.block_hashes import BlockHasher
from stages.routing.kv.prompt_tokens import PromptTokenizer
from stages.serve.proxy.config import KVConfig
from stages.serve.proxy.view.kv_events import KVEventSource, KVView


class Prompt(NamedTuple):
    tokens: int  # the prompt's length in tokens
    hashes: list[int]  # its full blocks' hashes, as the workers' KV events carry them
    block_size: int
    ids: Sequence[int] = ()  # the token ids (the signature at arrival predicts from them)

    @property
    def reusable(self) -> list[int]:
        """The blocks a worker holding them can skip: vLLM always computes the prompt's last
        token, so a hit covers whole blocks of the first ``tokens - 1``."""
        return self.hashes[: (self.tokens - 1) // self.block_size]


class KVRouting:
    def __init__(self, config: KVConfig) -> None:
        self.config = config
        self.tokenizer = PromptTokenizer(config.tokenizer)
        self.hasher = BlockHasher(config.hash_algo)
        self.prefill = KVView(len(config.prefill_events), config.silent_after_s)
        self.decode = KVView(len(config.decode_events), config.silent_after_s)
        # Prompt tokens each prefill worker has yet to compute for the requests sent to it:
        # its queue, in the currency of prefill time.
        self.prefill_queued = np.zeros(len(config.prefill_events), dtype=np.int64)

    def sources(self, role: str) -> list[KVEventSource | None]:
        events = self.config.prefill_events if role == "prefill" else self.config.decode_events
        return [None if e is None else KVEventSource.parse(e) for e in events]

    def prompt(self, body: dict[str, Any], chat: bool) -> Prompt | None:
        """``body``'s prompt as block hashes; None where it cannot be reproduced exactly (see
        ``PromptTokenizer``) or no worker has told its block size yet."""
        block_size = self.prefill.block_size or self.decode.block_size
        if block_size is None:
            return None
        ids = self.tokenizer.chat(body) if chat else self.tokenizer.completion(body)
        if ids is None:
            return None
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return None
        return Prompt(len(ids), self.hasher.hashes(ids, block_size, salt), block_size, ids)

    def state(self) -> dict[str, Any]:
        return {"prefill": self.prefill.state(), "decode": self.decode.state(),
                "prefill_queued_tokens": self.prefill_queued.tolist()}
