"""Completion prompts that share text with one encoded before reuse its ids: the ids (and so
the block hashes) come out as the whole prompt's, and a prompt the workers hold only the start
of is not encoded past a head."""

from __future__ import annotations

import itertools
from array import array
from typing import Any

import pytest

from stages.paths import BUNDLED_MODELS_DIR, CALIBRATION_PROMPTS, EVALUATION_PROMPTS
from stages.prompts import load_prompts
from stages.routing.kv.block_hashes import BlockHasher
from stages.routing.kv.known_texts import MARGIN_TOKENS, KnownTexts
from stages.serve.proxy.config import KVConfig
from stages.serve.proxy.view.kv_routing import KVRouting
from tests.test_kv_view import batch, stored

BLOCK = 16
SYSTEM = ("You are the water board's assistant. Answer from the annual reports on water"
          " quality, cite the district, and say when a figure is missing. ") * 12


@pytest.fixture
def kv() -> KVRouting:
    routing = KVRouting(KVConfig(str(BUNDLED_MODELS_DIR / "tiny"), (None,), (None,)))
    routing.prefill.apply(0, 0, batch(stored([1], block_size=BLOCK)))  # the block size
    return routing


def _whole(kv: KVRouting, text: str) -> list[int]:
    ids = kv.tokenizer.completion({"prompt": text})
    assert ids is not None
    return ids


def _hold(kv: KVRouting, text: str, blocks: int | None = None) -> list[int]:
    """Prefill worker 0 holds ``text``'s first ``blocks`` blocks (all if None)."""
    hashes = BlockHasher().hashes(_whole(kv, text), BLOCK)[:blocks]
    kv.prefill.apply(0, (kv.prefill.last_seq[0] or 0) + 1, batch(stored(hashes, block_size=BLOCK)))
    return hashes


def _encodes(kv: KVRouting, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of the texts the proxy encodes from now on."""
    assert kv.texts is not None
    seen: list[int] = []
    backend = kv.texts._backend

    class Spy:
        def encode(self, text: str, add_special_tokens: bool) -> Any:
            seen.append(len(text))
            return backend.encode(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(kv.texts, "_backend", Spy())
    return seen


def test_reused_ids_are_the_whole_prompts_in_every_bundled_language(kv) -> None:
    assert kv.texts is not None and kv.texts.enabled
    # Every 20th of the 2,400: each language and domain, a few times over.
    prompts = [p.prompt for path in (CALIBRATION_PROMPTS, EVALUATION_PROMPTS)
               for p in load_prompts(path)][::20]
    texts = kv.texts
    reused = 0
    for before, after in itertools.pairwise(prompts):
        for head in (before, before + " ", before + "\n\n", before[: len(before) // 2]):
            old, new = head + after, head + before
            texts.remember("k", old, texts.encode(old))
            reuse = texts.reuse("k", new)
            if reuse is None:
                continue
            rest = texts.rest(reuse, new)
            assert rest is not None, new[:60]
            joined = reuse.old.joined(reuse.restart, rest, reuse.restart_char)
            bare = kv.tokenizer.completion({"prompt": new, "add_special_tokens": False})
            assert joined.ids.tolist() == bare, new[:60]
            assert joined.starts.tolist() == texts.encode(new).starts.tolist()
            reused += 1
    assert reused > 50


def test_a_new_prompt_after_a_held_system_prompt_is_encoded_only_to_a_head(
        kv, monkeypatch) -> None:
    first = SYSTEM + "Which district had the most wells tested in spring? " * 30
    system_blocks = len(BlockHasher().hashes(_whole(kv, SYSTEM), BLOCK)) - 1
    _hold(kv, first, system_blocks)  # the workers hold the system prompt's blocks
    kv.prompt({"prompt": first}, chat=False)  # the first of its kind is encoded whole
    second = SYSTEM + "How many samples failed the nitrate limit last year? " * 30
    encoded = _encodes(kv, monkeypatch)
    prompt = kv.prompt({"prompt": second}, chat=False)
    assert prompt is not None
    whole = _whole(kv, second)
    assert sum(encoded) < len(second) // 3  # a head, not the prompt
    exact = BlockHasher().hashes(whole, BLOCK)
    assert prompt.hashes == exact[: len(prompt.hashes)]
    assert kv.prefill.cached_tokens(prompt.reusable).tolist() == [system_blocks * BLOCK]
    assert abs(prompt.tokens - len(whole)) <= 0.05 * len(whole)
    # Asked for every id (the signature at arrival), it has them all, as the whole prompt's.
    full = kv.prompt({"prompt": second}, chat=False, all_ids=True)
    assert full is not None and list(full.ids) == whole and full.hashes == exact


def test_a_prompt_held_beyond_what_is_known_is_encoded_to_its_end(kv) -> None:
    first = SYSTEM + "Which district had the most wells tested in spring? " * 30
    # A conversation's next turn: the workers hold the whole of the first prompt.
    _hold(kv, first)
    kv.prompt({"prompt": first}, chat=False)
    second = first + "And in autumn? " * 20
    prompt = kv.prompt({"prompt": second}, chat=False)
    whole = _whole(kv, second)
    assert prompt is not None and list(prompt.ids) == whole
    assert prompt.hashes == BlockHasher().hashes(whole, BLOCK)
    assert kv.prefill.cached_tokens(prompt.reusable).tolist() == [
        len(BlockHasher().hashes(_whole(kv, first), BLOCK)) * BLOCK]


def test_the_same_prompt_again_is_not_encoded(kv, monkeypatch) -> None:
    text = SYSTEM + "List the districts. " * 40
    _hold(kv, text)
    kv.prompt({"prompt": text}, chat=False)
    encoded = _encodes(kv, monkeypatch)
    prompt = kv.prompt({"prompt": text}, chat=False)
    assert encoded == [] and prompt is not None and list(prompt.ids) == _whole(kv, text)


def _hashes_made(kv: KVRouting, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of the id lists the proxy hashes into blocks from now on."""
    seen: list[int] = []
    hasher = kv.hasher

    class Spy:
        def hashes(self, ids: Any, block_size: int, salt: str | None = None) -> list[int]:
            seen.append(len(ids))
            return hasher.hashes(ids, block_size, salt)

    monkeypatch.setattr(kv, "hasher", Spy())
    return seen


def test_a_prompt_matched_whole_again_is_neither_encoded_nor_hashed(kv, monkeypatch) -> None:
    text = SYSTEM + "List the districts. " * 40
    _hold(kv, text)
    first = kv.prompt({"prompt": text}, chat=False)
    encoded, hashed = _encodes(kv, monkeypatch), _hashes_made(kv, monkeypatch)
    again = kv.prompt({"prompt": text}, chat=False, all_ids=True)
    assert encoded == [] and hashed == []
    assert again is not None and first is not None and again.hashes == first.hashes
    assert list(again.ids) == _whole(kv, text) and again.tokens == first.tokens
    # Another salt, or the prompt's own ids as given, is another prompt.
    salted = kv.prompt({"prompt": text, "cache_salt": "s"}, chat=False)
    assert salted is not None and salted.hashes != first.hashes


def test_a_prompt_matched_from_its_head_alone_is_matched_whole_once_held(kv) -> None:
    text = "A question nobody sent before, about the spring samples. " * 40
    unheld = kv.prompt({"prompt": text}, chat=False)
    assert unheld is not None and unheld.hashes == []  # held nowhere: its length estimated
    hashes = _hold(kv, text)
    held = kv.prompt({"prompt": text}, chat=False)
    assert held is not None and held.hashes == hashes and held.tokens == len(_whole(kv, text))


def test_prompts_matched_through_reuse_are_dropped_when_reuse_turns_off(
        kv, monkeypatch) -> None:
    text = SYSTEM + "List the districts. " * 40
    _hold(kv, text)
    kv.prompt({"prompt": text}, chat=False)
    assert kv.texts is not None
    kv.texts.enabled = False  # a reuse gave other ids than the whole text (verify)
    hashed = _hashes_made(kv, monkeypatch)
    again = kv.prompt({"prompt": text}, chat=False)
    assert hashed and again is not None and list(again.ids) == _whole(kv, text)


class _LookAhead:
    """A tokenizer whose first id depends on the text after it."""

    class _Encoding:
        def __init__(self, text: str) -> None:
            self.ids = [len(text) % 7, *(ord(c) for c in text[1:])]
            self.offsets = [(i, i + 1) for i in range(len(text))]

    def encode(self, text: str, add_special_tokens: bool = False) -> _LookAhead._Encoding:
        return self._Encoding(text)


def test_a_tokenizer_that_looks_ahead_gets_no_reuse() -> None:
    texts = KnownTexts(_LookAhead())
    assert not texts.enabled
    texts.remember("k", "some words here", texts.encode("some words here"))
    assert texts.reuse("k", "some words here and more") is None


def test_a_reuse_that_differs_from_the_whole_text_turns_reuse_off(kv) -> None:
    texts = KnownTexts(kv.texts._backend, verify_every=1)
    assert texts.enabled
    assert texts.verify("some words", texts.encode("some words").ids)
    assert not texts.verify("some words", array("i", [1, 2, 3]))
    assert not texts.enabled


def test_the_store_keeps_its_bound(kv) -> None:
    texts = KnownTexts(kv.texts._backend, max_chars=1000)
    for i in range(50):
        text = f"{i} " + "words " * 40
        texts.remember(i, text, texts.encode(text))
    assert texts.chars <= 1000
    assert texts.reuse(49, "49 " + "words " * 41) is not None
    assert texts.reuse(0, "0 " + "words " * 41) is None


def _trained(kind: str, prompts: list[str]) -> Any:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    if kind.startswith("unigram"):
        tok = Tokenizer(models.Unigram())
        trainer: Any = trainers.UnigramTrainer(vocab_size=1000, special_tokens=["<unk>"],
                                               unk_token="<unk>")
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>"])
    tok.pre_tokenizer = {
        "bytelevel": pre_tokenizers.ByteLevel(add_prefix_space=False),
        "bytelevel-nfkc": pre_tokenizers.ByteLevel(add_prefix_space=False),
        "metaspace": pre_tokenizers.Metaspace(prepend_scheme="first"),
        "unigram-metaspace": pre_tokenizers.Metaspace(prepend_scheme="always"),
        "whitespace": pre_tokenizers.Whitespace(),
    }[kind]
    if kind.endswith("nfkc"):
        tok.normalizer = normalizers.NFKC()
    tok.train_from_iterator(prompts, trainer)
    return tok


@pytest.mark.parametrize("kind", ["bytelevel", "bytelevel-nfkc", "metaspace",
                                  "unigram-metaspace", "whitespace"])
def test_reuse_never_gives_other_ids_than_the_whole_text_in_other_tokenizers(kind) -> None:
    """Tokenizers of the other kinds real models ship (SentencePiece-style Metaspace, Unigram,
    a normalizer): a reuse either reproduces the whole text's ids or is refused."""
    prompts = [p.prompt for path in (CALIBRATION_PROMPTS, EVALUATION_PROMPTS)
               for p in load_prompts(path)][::20]
    tok = _trained(kind, prompts)
    texts = KnownTexts(tok)
    reused = 0
    for before, after in itertools.pairwise(prompts):
        for head in (before, before + " ", before[: len(before) // 2]):
            old, new = head + after, head + before
            texts.remember("k", old, texts.encode(old))
            reuse = texts.reuse("k", new)
            rest = None if reuse is None else texts.rest(reuse, new)
            if reuse is not None and rest is not None:
                joined = reuse.old.joined(reuse.restart, rest, reuse.restart_char)
                assert joined.ids.tolist() == tok.encode(new, add_special_tokens=False).ids
                reused += 1
    # A pre-tokenizer that drops the spaces leaves no id starting at one: nothing is reused.
    assert (reused == 0) if kind == "whitespace" else (reused > 100)


def test_a_conversation_finds_its_own_last_turn_among_many_sharing_its_system_prompt(kv) -> None:
    texts = kv.texts
    turns = [f"{SYSTEM}User {i}: which wells in district {i} were tested? " * 2
             for i in range(40)]
    for turn in turns:
        texts.remember("k", turn, texts.encode(turn))
    following = turns[0] + "Assistant: the northern ones. User: and in autumn?"
    reuse = texts.reuse("k", following)
    assert reuse is not None
    assert reuse.tokens == len(texts.encode(turns[0]).ids) - MARGIN_TOKENS
