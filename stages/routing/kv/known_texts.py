"""Completion prompts encoded once: a new prompt reuses the ids of the longest text it shares
with a prompt encoded before, and only its own part is encoded.

A completion prompt has no special token to cut it at (``segment_cache`` cuts chat prompts
there), so without this every prompt after a shared system prompt is encoded whole: about
1.2 ms per 2,000 tokens on one core, most of a routing decision. Reuse rests on one property of
tokenizers that split their text into words before merging (byte-level BPE, as Llama 3, Qwen,
Mistral's newer ones and the bundled models): the ids of the text before a word do not depend
on the text after it. So, against a text encoded before:

- the ids of the shared characters are the old ids, up to ``MARGIN_TOKENS`` before the first
  difference (the word the difference falls in may merge otherwise);
- the rest is encoded from a word start inside the shared part: the old ids after that start
  must come out again (``OVERLAP_TOKENS`` of them, checked on every reuse), or the prompt is
  encoded whole.

Whether this tokenizer behaves so is checked on sample texts when the store is built, and on
one reuse in ``verify_every`` against the whole text's ids; a difference turns reuse off for
good, with a warning. Texts are kept by a key the caller chooses (its first block's head, so
only prompts that could share blocks are compared), most recent first, bounded by characters.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

# The ids this many tokens before the first differing character may belong to the word it
# falls in: they are not reused.
MARGIN_TOKENS = 16
# Old ids the rest's encoding must reproduce from its word start before it is trusted.
OVERLAP_TOKENS = 8
# Texts are found by their first FIRST_LEVEL, 2 x FIRST_LEVEL, 4 x ... characters: a new text
# is compared with the (at most PER_BUCKET newest) texts that share the longest of these with
# it, so a conversation finds its own last turn among many that share its system prompt.
FIRST_LEVEL = 256
PER_BUCKET = 4
# About 16 MiB of text, plus 12 bytes of ids and offsets per token.
DEFAULT_MAX_CHARS = 1 << 24

_SAMPLES = (
    "The committee reviewed the annual report on water quality in each district, and"
    " then it adjourned until 12:45 on the 3rd of May.\n\nNext, unbelievable   spacing",
    "Ünïcödé wörds, 漢字 and ひらがな mixed with digits 1234567890 and punctuation!? ok.",
)


class Encoded(NamedTuple):
    """A text's ids with the character each starts at (its first, where several ids share a
    character), and the text's length."""

    ids: array[int]
    starts: array[int]
    chars: int

    def joined(self, tokens: int, rest: Encoded, offset: int) -> Encoded:
        """This text's first ``tokens`` ids followed by ``rest``'s, which start at
        character ``offset``."""
        starts = self.starts[:tokens]
        starts.extend(s + offset for s in rest.starts)
        return Encoded(self.ids[:tokens] + rest.ids, starts, offset + rest.chars)


class Reuse(NamedTuple):
    """What a new text keeps of an old one: the old ids ``ids[:tokens]``, valid for it, and
    where the new text's own encoding may restart (a word start ``restart`` ids in, at
    character ``restart_char``)."""

    old: Encoded
    tokens: int
    restart: int
    restart_char: int


class KnownTexts:
    def __init__(self, backend: Any, max_chars: int = DEFAULT_MAX_CHARS,
                 verify_every: int = 256) -> None:
        """``backend``: a Rust ``tokenizers.Tokenizer`` (offsets come with its ids)."""
        self._backend = backend
        # Texts by number, least recently used first, and the numbers of those that start
        # alike (key, level, hash of the text's first ``level`` characters), newest first.
        self._entries: OrderedDict[int, tuple[str, Encoded, list[tuple[Any, ...]]]] = (
            OrderedDict())
        self._alike: dict[tuple[Any, ...], list[int]] = {}
        self._next = 0
        self._max_chars = max_chars
        self.chars = 0
        self._verify_every = verify_every
        self._reuses = 0
        self.enabled = all(self._reproduces(text) for text in _SAMPLES)
        if not self.enabled:
            log.info("this tokenizer's ids depend on text after a word: completion prompts"
                     " are encoded whole")

    def encode(self, text: str) -> Encoded:
        enc = self._backend.encode(text, add_special_tokens=False)
        return Encoded(array("i", enc.ids), array("i", [s for s, _ in enc.offsets]), len(text))

    def remember(self, key: Hashable, text: str, encoded: Encoded) -> None:
        buckets = _buckets(key, text)
        for number in self._alike.get(buckets[-1], ()):
            if self._entries[number][0] == text:
                self._forget(number)
                break
        number = self._next
        self._next += 1
        self._entries[number] = (text, encoded, buckets)
        self.chars += len(text)
        for bucket in buckets:
            alike = self._alike.setdefault(bucket, [])
            alike.insert(0, number)
            if len(alike) > PER_BUCKET:
                alike.pop()  # still found by its longer prefixes, if others do not share them
        while self.chars > self._max_chars and len(self._entries) > 1:
            self._forget(next(iter(self._entries)))

    def _forget(self, number: int) -> None:
        text, _, buckets = self._entries.pop(number)
        self.chars -= len(text)
        for bucket in buckets:
            alike = self._alike.get(bucket)
            if alike is not None and number in alike:
                alike.remove(number)
                if not alike:
                    del self._alike[bucket]

    def reuse(self, key: Hashable, text: str) -> Reuse | None:
        """The most ``text`` can keep of a text remembered under ``key``; None where it keeps
        nothing (or reuse is off). Compared only with the texts that share its longest
        prefix of a level's length with it."""
        if not self.enabled:
            return None
        candidates: list[int] = []
        for bucket in reversed(_buckets(key, text)):
            candidates = self._alike.get(bucket, [])
            if candidates:
                break
        best: Reuse | None = None
        for number in candidates:
            old_text, old, _ = self._entries[number]
            self._entries.move_to_end(number)
            shared = _common_prefix(old_text, text)
            if shared == len(old_text) == len(text):
                tokens = len(old.ids)  # the same text: every id stands
            else:
                # Ids starting at or after the difference are the new text's own, and the
                # margin's worth before it may merge with what follows.
                tokens = _bisect(old.starts, shared) - MARGIN_TOKENS
            restart = _word_start(old_text, old.starts, tokens - OVERLAP_TOKENS)
            if restart is not None and (best is None or tokens > best.tokens):
                best = Reuse(old, tokens, restart, old.starts[restart])
        return best

    def rest(self, reuse: Reuse, text: str, end: int | None = None) -> Encoded | None:
        """The new text's ids from ``reuse.restart`` on, encoding ``text[restart_char:end]``
        (offsets from there); None where the old ids it repeats do not come out again
        (encode whole instead)."""
        enc = self.encode(text[reuse.restart_char:end])
        if enc.ids[:reuse.tokens - reuse.restart] != reuse.old.ids[reuse.restart:reuse.tokens]:
            return None
        return enc

    def verify(self, text: str, ids: array[int]) -> bool:
        """Count one reuse and, every ``verify_every``, check ``ids`` against the whole
        text's; False (and reuse off from now on) where they differ."""
        self._reuses += 1
        if self._reuses % self._verify_every:
            return True
        if self._backend.encode(text, add_special_tokens=False).ids == ids.tolist():
            return True
        self.enabled = False
        log.warning("reusing a known prompt's ids gave other ids than the whole text:"
                    " completion prompts are encoded whole from now on")
        return False

    def _reproduces(self, text: str) -> bool:
        """Whether encoding from each word start reproduces the whole text's ids."""
        whole = self.encode(text)
        for i in range(1, len(whole.ids)):
            if _word_start(text, whole.starts, i) != i:
                continue
            rest = self._backend.encode(text[whole.starts[i]:], add_special_tokens=False).ids
            if rest != whole.ids[i:].tolist():
                return False
        return True


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix, by halving (slices compare in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1] stays true
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _bisect(starts: array[int], char: int) -> int:
    """How many ids start before ``char``."""
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] < char:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _word_start(text: str, starts: array[int], at_most: int) -> int | None:
    """The last id at or before ``at_most`` (and after the first) that starts at whitespace
    (a word and its leading space, in a byte-level tokenizer): one that starts after it may be
    a later byte of a character the id before began."""
    for i in range(min(at_most, len(starts) - 1), 0, -1):
        c = starts[i]
        if c != starts[i - 1] and text[c].isspace():
            return i
    return None


def _buckets(key: Hashable, text: str) -> list[tuple[Any, ...]]:
    """Where ``text`` is found: by ``key`` alone, then by each level's prefix, shortest
    first (a hash: two texts that collide are only compared in vain)."""
    out: list[tuple[Any, ...]] = [(key,)]
    level = FIRST_LEVEL
    while level <= len(text):
        out.append((key, level, hash(text[:level])))
        level *= 2
    return out
