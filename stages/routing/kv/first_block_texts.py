"""Which texts a held first block can start: a new prompt that starts like none of them is held
nowhere, and needs no tokenizing to be matched.

A request's blocks can be held only if its first block is, and vLLM's KV events carry the token
ids of every stored block whose parent is none (a sequence's first). Decoded once per such
block, the first ``KEY_CHARS`` characters of its text are kept; a prompt whose text does not
start with any kept key cannot have its first block held anywhere, and is routed on its length
alone without encoding even its head (about 0.2 ms of a 2,000-token prompt's decision, as much
as all the rest of eldr-union's). A prompt that starts like a key is matched as before: the
key only rules out.

Ruling out is sound where the tokenizer's decoding gives back the very text it encoded (byte-
level BPE, SentencePiece without a normalizer): checked on sample texts when this is built,
and off otherwise. Keys are kept most recent first and bounded; one forgotten while its block
is held would only cost that prompt's hit, and a key kept after its block went only an encode.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from stages.routing.kv.event_messages import BlockStored, leading_ids

log = logging.getLogger(__name__)

# Characters of a first block's text kept as its key: long enough that unrelated prompts
# rarely share one, short enough that a block of 16 tokens (a GPU's) has them.
KEY_CHARS = 24
DEFAULT_MAX_KEYS = 1 << 16
# A first block's ids read and decoded for its key: a key's characters take a few ids (the
# whole block is read only where these give fewer characters than a key: digits, CJK).
KEY_IDS = 32
_SAMPLES = (
    "The committee reviewed the annual report on water quality in each district.",
    "  Leading spaces, ünïcödé, 漢字 and digits 0123456789 in one line\n\nthen another.",
)


class FirstBlockTexts:
    def __init__(self, backend: Any, head_specials: Sequence[int] = (),
                 max_keys: int = DEFAULT_MAX_KEYS) -> None:
        """``backend``: a Rust ``tokenizers.Tokenizer``; ``head_specials``: the ids the
        tokenizer puts before a completion prompt's text (a BOS), absent from its text."""
        self._backend = backend
        self._head = list(head_specials)
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._seen: OrderedDict[int | bytes, None] = OrderedDict()  # first blocks read
        # Texts of first blocks shorter than a key, by length (a GPU's 16-token blocks of
        # CJK text): each length is one slice and lookup.
        self._short: dict[int, set[str]] = {}
        self._max_keys = max_keys
        self.enabled = all(self._round_trips(text) for text in _SAMPLES)

    def stored_event(self, event: BlockStored) -> None:
        """A worker's ``BlockStored``: a sequence's first block is read once, whichever
        workers store it (a prompt's prefill worker, then its decode worker)."""
        if event.parent_block_hash is not None or not event.block_hashes:
            return
        first = event.block_hashes[0]
        if first in self._seen:
            self._seen.move_to_end(first)
            return
        self._seen[first] = None
        if len(self._seen) > self._max_keys:
            self._seen.popitem(last=False)
        size = event.block_size
        try:
            carried, ids = leading_ids(event.token_ids, min(KEY_IDS, size))
        except ValueError as exc:
            log.warning("a worker's KV event carries token ids that cannot be read: %s", exc)
            carried, ids = 0, []
        if carried < size:
            self._off()
        elif not self._keyed(ids):  # a short text (CJK, bytes): the whole block is read
            self.stored(leading_ids(event.token_ids, size)[1], size)

    def stored(self, first_block_ids: Sequence[int], block_size: int) -> None:
        """A worker stored a sequence's first block of these ids. A publisher that leaves
        them out (or sends fewer than a block) leaves nothing to rule out by: off for good."""
        ids = list(first_block_ids)
        if len(ids) < block_size:
            self._off()
            return
        for text in self._texts(ids):
            if len(text) < KEY_CHARS:
                self._short.setdefault(len(text), set()).add(text)
            else:
                self._key(text[:KEY_CHARS])

    def _keyed(self, leading: list[int]) -> bool:
        """Keys from a first block's leading ids alone: the text of a block's first ids is
        the start of its whole text (checked at start, ``_round_trips``). False, and nothing
        kept, where they give fewer characters than a key."""
        texts = self._texts(leading)
        if any(len(text) < KEY_CHARS for text in texts):
            return False
        for text in texts:
            self._key(text[:KEY_CHARS])
        return True

    def _texts(self, ids: list[int]) -> list[str]:
        """What ``ids`` decode to, and without the completion's BOS where they start so."""
        variants = [ids]
        if self._head and ids[:len(self._head)] == self._head:
            variants.append(ids[len(self._head):])  # a completion's text lacks its BOS
        # A last id may be part of a character: what precedes it is exact.
        return [self._backend.decode(v, skip_special_tokens=False).rstrip("\ufffd")
                for v in variants]

    def _key(self, key: str) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)
        else:
            self._keys[key] = None
            if len(self._keys) > self._max_keys:
                self._keys.popitem(last=False)

    def _off(self) -> None:
        if self.enabled:
            log.info("a worker's KV events carry no token ids: every prompt is tokenized"
                     " to be matched")
        self.enabled = False

    def may_be_held(self, text: str) -> bool:
        """False where no held first block can start ``text`` (or this is off: True)."""
        if not self.enabled or text[:KEY_CHARS] in self._keys:
            return True
        return any(text[:n] in texts for n, texts in self._short.items())

    def _round_trips(self, text: str) -> bool:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return all(text.startswith(
            self._backend.decode(ids[:n], skip_special_tokens=False).rstrip("\ufffd"))
            for n in range(1, len(ids) + 1))
