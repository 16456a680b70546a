"""Tokenizing a conversation's prompt without tokenizing its history again.

A tokenizer cuts a text at its added (special) tokens before anything else and encodes the
pieces between them on their own, so a text's ids are its pieces' ids in order. A chat template
ends each message with such a token (``</s>``, ``<|im_end|>``, ``<|eot_id|>``), so turn k+1's
rendered prompt repeats turn k's pieces: kept in an LRU, only the new message's pieces are
encoded. Whether a tokenizer really encodes pieces alone (a normalizer or pre-tokenizer that
looks across a cut would not) is checked on sample texts when the cache is built and again on
one request in ``verify_every``, against the whole text's ids; a difference turns the cache off
for good, with a warning, and the text is encoded whole.
"""

from __future__ import annotations

import logging
import re
from array import array
from collections import OrderedDict
from typing import Any

log = logging.getLogger(__name__)

# Bounded by the ids it holds, not by pieces: pieces run from a role tag to a whole prompt. At
# 4 bytes an id plus the text (about 4 bytes a token), 4 Mi tokens is about 32 MiB.
DEFAULT_MAX_TOKENS = 1 << 22

SAMPLES = (
    "plain text, no special token at all",
    " leading space and trailing space ",
    "digits 12345 and\nnew lines\n\n",
)


class SegmentCache:
    def __init__(self, tokenizer: Any, max_tokens: int = DEFAULT_MAX_TOKENS,
                 verify_every: int = 512, backend: Any | None = None) -> None:
        """``backend``: the tokenizer's Rust half, where it encodes as the tokenizer does
        (``PromptTokenizer.backend``): a new piece is encoded by it directly, without the
        Python wrapper's work around each call (the samples below and the checks on live
        requests still compare with the tokenizer's own ids)."""
        self._tok = tokenizer
        self._backend = backend
        # Ids as 4-byte arrays: a tuple of Python ints costs ~36 bytes a token, and single-turn
        # traffic puts every prompt in here whole (2,000 tokens: 72 KB as a tuple).
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        self._max_tokens = max_tokens
        self.tokens = 0  # ids held, all pieces together
        self._verify_every = verify_every
        self._count = 0
        specials = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)
        self._cut = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        self.enabled = self._cut is not None and all(
            self._cached(text) == self._whole(text) for text in self._samples(specials))
        if self._cut is not None and not self.enabled:
            log.info("tokenizer encodes across its special tokens: prompts encoded whole")
        self._pieces.clear()
        self.tokens = 0

    @staticmethod
    def _samples(specials: list[str]) -> list[str]:
        joined = [s.join(SAMPLES) for s in specials]
        return [*joined, *(f"{s}{t}{s}" for s in specials for t in SAMPLES)]

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, no special tokens added beyond those it contains."""
        if not self.enabled:
            return self._whole(text)
        ids = self._cached(text)
        self._count += 1
        if self._count % self._verify_every == 0 and ids != self._whole(text):
            self.enabled = False
            log.warning("tokenizing by pieces gave other ids than the whole text: prompts are"
                        " encoded whole from now on")
            return self._whole(text)
        return ids

    def _whole(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def _encode_piece(self, piece: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(piece, add_special_tokens=False).ids
        return self._tok.encode(piece, add_special_tokens=False)

    def _cached(self, text: str) -> list[int]:
        assert self._cut is not None
        ids: list[int] = []
        pieces = self._pieces
        for piece in self._cut.split(text):
            if not piece:
                continue
            hit = pieces.get(piece)
            if hit is None:
                hit = array("i", self._encode_piece(piece))
                pieces[piece] = hit
                self.tokens += len(hit)
                while self.tokens > self._max_tokens and len(pieces) > 1:
                    self.tokens -= len(pieces.popitem(last=False)[1])
            else:
                pieces.move_to_end(piece)
            ids.extend(hit)
        return ids
