"""What KV-cache-aware routing knows in one proxy: each pool's view of its workers' caches,
and a request's prompt as the block hashes those workers compute for it."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from stages.routing.kv.block_hashes import BlockHasher
from stages.routing.kv.first_block_texts import FirstBlockTexts
from stages.routing.kv.known_texts import Encoded, KnownTexts
from stages.routing.kv.prompt_tokens import PromptTokenizer, Rendered
from stages.routing.scorers.prefill_queue import shared_queue
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

    @property
    def unhashed(self) -> bool:
        """Whether full blocks follow ``hashes`` that no worker holds (a prompt matched from
        its head alone): the worker it is sent to will store them. Its length is estimated
        there, so a block's margin keeps a short rest from passing for one."""
        return self.tokens // self.block_size > len(self.hashes) + 1


# A prompt's head, encoded alone to learn whether anyone holds its first block: this many
# characters for each token of a block (about two blocks of English text) ...
HEAD_CHARS_PER_TOKEN = 8
# ... of which the first block's ids must lie this many tokens before the cut.
HEAD_MARGIN_TOKENS = 16
# Text whose tokens a character start the estimate of a prompt held nowhere, until prompts
# encoded since take over.
LENGTH_SAMPLE = ("The committee reviewed the annual report on water quality in each district,"
                 " and asked which wells were tested in spring and which failed the limit.")
# Heads whose first block is known, most recent kept: ~1 KB of text each at block size 128.
MAX_HEADS = 8192
# Prompts matched whole, by their text: one sent again (a retry, a popular question, a
# client's loop) is a lookup, not its ids joined and every block's hash looked up again
# (~100 us at 2,000 tokens). Their texts are kept up to this many characters, ids as 4 bytes.
MAX_EXACT_CHARS = 1 << 22


class KVRouting:
    def __init__(self, config: KVConfig) -> None:
        self.config = config
        self.tokenizer = PromptTokenizer(config.tokenizer)
        self.hasher = BlockHasher(config.hash_algo)
        backend = self.tokenizer.backend
        self.first_texts = None if backend is None else FirstBlockTexts(
            backend, self.tokenizer.head_specials)
        stored = None if self.first_texts is None else self.first_texts.stored_event
        self.prefill = KVView(len(config.prefill_events), config.silent_after_s,
                              first_blocks=stored)
        self.decode = KVView(len(config.decode_events), config.silent_after_s,
                             first_blocks=stored)
        # Prompt tokens each prefill worker has yet to compute for the requests sent to it:
        # its queue, in the currency of prefill time.
        self.prefill_queued = np.zeros(len(config.prefill_events), dtype=np.int64)
        # Prefill workers that share compute, grouped (None: each has its own): see
        # ``prefill_queue``.
        shared = len(set(config.prefill_compute)) < len(config.prefill_compute)
        self.prefill_groups = np.array(config.prefill_compute, dtype=np.int64) if shared else None
        self._first_blocks: OrderedDict[tuple[Any, ...], tuple[int, int]] = OrderedDict()
        # Tokens a character, as the prompts encoded so far had them: a prompt held nowhere is
        # priced by its length in characters alone.
        sample = self.tokenizer.completion({"prompt": LENGTH_SAMPLE,
                                            "add_special_tokens": False}) or []
        self._tokens_per_char = len(sample) / len(LENGTH_SAMPLE)
        self.texts = None if backend is None else KnownTexts(backend)
        self._exact: OrderedDict[tuple[Rendered, str | None, int], Prompt] = OrderedDict()
        self._exact_chars = 0
        self._exact_encoders = self._encoders()

    def prefill_queue(self, loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Requests and prompt tokens queued ahead of a new prefill on each prefill worker's
        compute: its own, or its group's where workers share cores or a GPU."""
        if self.prefill_groups is None:
            return loads, self.prefill_queued
        return (shared_queue(loads, self.prefill_groups),
                shared_queue(self.prefill_queued, self.prefill_groups))

    def sources(self, role: str) -> list[KVEventSource | None]:
        events = self.config.prefill_events if role == "prefill" else self.config.decode_events
        return [None if e is None else KVEventSource.parse(e) for e in events]

    def prompt(self, body: dict[str, Any], chat: bool, all_ids: bool = False) -> Prompt | None:
        """``body``'s prompt as block hashes; None where it cannot be reproduced exactly (see
        ``PromptTokenizer``) or no worker has told its block size yet.

        A prompt whose first block no worker holds is held nowhere, and matching it needs no
        more of its ids: only its head is encoded, its length estimated from it, and its blocks
        left unknown (``hashes`` empty). Single-turn traffic of new prompts then costs about
        an eighth of a 2,000-token prompt's encoding. ``all_ids``: encode it all anyway (the
        signature at arrival predicts from every id)."""
        # What the workers' streams brought first: the block size, the first blocks' texts and
        # the blocks held, as matching reads them below.
        self.prefill.flush()
        self.decode.flush()
        block_size = self.prefill.block_size or self.decode.block_size
        if block_size is None:
            return None
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return None
        rendered = self.tokenizer.render(body, chat)
        if rendered is None:
            return None
        if rendered.text is None:  # token ids: nothing to encode
            return self._match(rendered, block_size, salt, chat, all_ids)
        encoders = self._encoders()
        if encoders != self._exact_encoders:
            # An encoder that reuses earlier ids found a wrong reuse and turned itself off:
            # the prompts matched through it go too.
            self._exact.clear()
            self._exact_chars, self._exact_encoders = 0, encoders
        key = (rendered, salt, block_size)
        known = self._exact.get(key)
        if known is not None:
            self._exact.move_to_end(key)
            return known
        prompt = self._match(rendered, block_size, salt, chat, all_ids)
        if prompt is not None and prompt.ids and len(prompt.ids) == prompt.tokens:
            self._remember(key, prompt._replace(ids=array("i", prompt.ids)))
        return prompt

    def _encoders(self) -> tuple[bool, bool]:
        """Whether the encoders that reuse earlier ids are on: known texts, chat pieces."""
        return (self.texts is not None and self.texts.enabled, self.tokenizer.reuses_pieces)

    def _remember(self, key: tuple[Rendered, str | None, int], prompt: Prompt) -> None:
        """Keeps a prompt matched whole (every id encoded, every full block hashed): what it
        is does not depend on what the workers hold."""
        self._exact[key] = prompt
        self._exact_chars += len(key[0].text or "")
        while self._exact_chars > MAX_EXACT_CHARS and len(self._exact) > 1:
            (rendered, _, _), _ = self._exact.popitem(last=False)
            self._exact_chars -= len(rendered.text or "")

    def _match(self, rendered: Rendered, block_size: int, salt: str | None, chat: bool,
               all_ids: bool) -> Prompt | None:
        text = rendered.text
        chars = HEAD_CHARS_PER_TOKEN * block_size
        if not all_ids and text is not None and len(text) > 2 * chars:
            if self.first_texts is not None and not self.first_texts.may_be_held(text):
                return Prompt(len(rendered.before) + round(len(text) * self._tokens_per_char),
                              [], block_size)
            first = self._first_block(rendered, text[:chars], block_size, salt)
            if first is not None and not self._held_anywhere(first[0]):
                return Prompt(round(first[1] * len(text) / chars), [], block_size)
        if (not chat and text is not None and not rendered.whole and not rendered.after
                and self.texts is not None and self.texts.enabled):
            return self._completion((text[:chars], rendered.before, salt, block_size), text,
                                    list(rendered.before), block_size, salt, all_ids)
        ids = self.tokenizer.ids(rendered)
        if ids is None:
            return None
        return Prompt(len(ids), self.hasher.hashes(ids, block_size, salt), block_size, ids)

    def _learn_length(self, tokens: int, chars: int) -> None:
        if chars:
            self._tokens_per_char += 0.05 * (tokens / chars - self._tokens_per_char)

    def _held_anywhere(self, block_hash: int) -> bool:
        return (self.prefill.index.held_anywhere(block_hash)
                or self.decode.index.held_anywhere(block_hash))

    def _completion(self, key: tuple[Any, ...], text: str, before: list[int], block_size: int,
                    salt: str | None, all_ids: bool) -> Prompt:
        """A completion prompt matched from the longest text it shares with one encoded
        before (``KnownTexts``): nothing is encoded while the blocks it already knows show
        that the workers' caches end within them; else the rest is encoded from there, first
        only a head (its next block unheld: done), then all."""
        assert self.texts is not None
        texts = self.texts
        reuse = texts.reuse(key, text)
        if reuse is None:
            return self._whole(key, text, before, block_size, salt)
        old = reuse.old
        known = len(before) + reuse.tokens
        hashes = self.hasher.hashes([*before, *old.ids[:reuse.tokens]], block_size, salt)
        if reuse.tokens == len(old.ids) and old.chars == len(text):  # the same text again
            return Prompt(known, hashes, block_size, [*before, *old.ids])
        per_char = len(old.ids) / max(1, old.chars)
        if not all_ids and hashes and not self._held_anywhere(hashes[-1]):
            # The workers' caches end within the known blocks: the rest is only counted.
            known_chars = old.starts[reuse.tokens] if reuse.tokens < len(old.ids) else old.chars
            return Prompt(known + round((len(text) - known_chars) * per_char), hashes,
                          block_size)
        end = reuse.restart_char + HEAD_CHARS_PER_TOKEN * block_size
        if not all_ids and end < len(text):
            head = texts.rest(reuse, text, end)
            if head is None:
                return self._whole(key, text, before, block_size, salt)
            trusted = [*before, *old.ids[:reuse.restart], *head.ids[:-HEAD_MARGIN_TOKENS]]
            hashes = self.hasher.hashes(trusted, block_size, salt)
            following = len(before) + reuse.tokens
            if len(hashes) * block_size > following and not self._held_anywhere(
                    hashes[following // block_size]):
                return Prompt(len(trusted) + round((len(text) - end) * per_char)
                              + HEAD_MARGIN_TOKENS, hashes, block_size)
        rest = texts.rest(reuse, text)
        if rest is None:
            return self._whole(key, text, before, block_size, salt)
        encoded = old.joined(reuse.restart, rest, reuse.restart_char)
        if not texts.verify(text, encoded.ids):
            return self._whole(key, text, before, block_size, salt)
        texts.remember(key, text, encoded)
        ids = [*before, *encoded.ids]
        return Prompt(len(ids), self.hasher.hashes(ids, block_size, salt), block_size, ids)

    def _whole(self, key: tuple[Any, ...], text: str, before: list[int], block_size: int,
               salt: str | None) -> Prompt:
        assert self.texts is not None
        encoded: Encoded = self.texts.encode(text)
        self.texts.remember(key, text, encoded)
        self._learn_length(len(encoded.ids), len(text))
        ids = [*before, *encoded.ids]
        return Prompt(len(ids), self.hasher.hashes(ids, block_size, salt), block_size, ids)

    def _first_block(self, rendered: Rendered, head_text: str, block_size: int,
                     salt: str | None) -> tuple[int, int] | None:
        """The hash of the first block of a prompt that starts with ``head_text``, and how
        many ids the head has; None where the head is too short to tell. Kept by head: a
        conversation's turns and a system prompt's requests share theirs."""
        key = (head_text, rendered.before, salt, block_size)
        known = self._first_blocks.get(key)
        if known is not None:
            self._first_blocks.move_to_end(key)
            return known
        head = self.tokenizer.head_ids(rendered, len(head_text))
        self._learn_length(len(head) - len(rendered.before), len(head_text))
        # A cut can change the ids of the word it falls in, never of the words before.
        if len(head) < block_size + HEAD_MARGIN_TOKENS:
            return None
        known = (self.hasher.hashes(head[:block_size], block_size, salt)[0], len(head))
        self._first_blocks[key] = known
        if len(self._first_blocks) > MAX_HEADS:
            self._first_blocks.popitem(last=False)
        return known

    def state(self) -> dict[str, Any]:
        config = self.config
        return {"prefill": _with_endpoints(self.prefill.state(), config.prefill_events),
                "decode": _with_endpoints(self.decode.state(), config.decode_events),
                # The workers' block size, once their first stored block told it (None before).
                "block_size": self.prefill.block_size or self.decode.block_size,
                "prefill_queued_tokens": self.prefill_queued.tolist(),
                # Prefill workers priced by one queue (they share cores or a GPU).
                "prefill_compute_groups": list(config.prefill_compute)}


def _with_endpoints(rows: list[dict[str, Any]], endpoints: tuple[str | None, ...]
                    ) -> list[dict[str, Any]]:
    """Each worker's row with where its KV events are followed (for another router, or a
    person, to follow the same)."""
    return [{**row, "endpoint": endpoint} for row, endpoint in zip(rows, endpoints, strict=True)]
