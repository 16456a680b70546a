"""Tokenizing by pieces between special tokens gives the whole text's ids, or is turned off."""

from __future__ import annotations

from transformers import AutoTokenizer

from stages.paths import BUNDLED_MODELS_DIR
from stages.routing.kv.segment_cache import SegmentCache

TINY = str(BUNDLED_MODELS_DIR / "tiny")


def test_a_conversation_is_tokenized_as_a_whole_text_is_and_its_history_once() -> None:
    tok = AutoTokenizer.from_pretrained(TINY)
    cache = SegmentCache(tok, verify_every=1)
    assert cache.enabled
    history = [{"role": "system", "content": "Answer in one line. " * 40}]
    for turn in range(4):
        history.append({"role": "user", "content": f" question {turn}:\n  why 12 + {turn}?"})
        text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        assert cache.encode(text) == tok.encode(text, add_special_tokens=False)
        history.append({"role": "assistant", "content": f"because {turn}.\n\n"})
    pieces = len(cache._pieces)
    text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    cache.encode(text)
    assert len(cache._pieces) == pieces + 1  # only the last answer was new


class Merging:
    """A tokenizer whose special token does not cut: a text is one id, its length."""

    all_special_tokens = ("|",)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(text)]


def test_a_tokenizer_that_encodes_across_its_special_tokens_is_not_cut() -> None:
    cache = SegmentCache(Merging())
    assert not cache.enabled
    assert cache.encode("a|b") == [3]


class Drifting:
    """Agrees on the samples, then not: the checks on live requests turn the cache off."""

    all_special_tokens = ("|",)
    calls = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        Drifting.calls += 1
        if "LIVE" in text and "|" in text:
            return [-1]
        return [ord(c) for c in text]


def test_a_difference_seen_on_a_live_request_turns_the_cache_off() -> None:
    cache = SegmentCache(Drifting(), verify_every=2)
    assert cache.enabled
    cache.encode("LIVE|one")
    assert cache.enabled  # not checked yet
    assert cache.encode("LIVE|two") == [-1]  # checked, different: the whole text's ids
    assert not cache.enabled


def test_the_cache_is_bounded_by_the_ids_it_holds_not_by_pieces() -> None:
    tok = AutoTokenizer.from_pretrained(TINY)
    cache = SegmentCache(tok, max_tokens=1000)
    for i in range(30):  # single-turn traffic: every prompt one new piece of ~200 tokens
        text = f"request {i}: " + "the committee reviewed the annual report " * 30
        assert cache.encode(text) == tok.encode(text, add_special_tokens=False)
    assert 0 < cache.tokens <= 1000
    assert cache.tokens == sum(len(ids) for ids in cache._pieces.values())
    assert len(cache._pieces) < 30  # the oldest went


class Counting:
    """A tokenizer that counts the texts it is asked to encode."""

    def __init__(self, tok: object) -> None:
        self.tok = tok
        self.all_special_tokens = tok.all_special_tokens  # type: ignore[attr-defined]
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        return self.tok.encode(text, add_special_tokens=add_special_tokens)  # type: ignore


def test_new_pieces_are_encoded_by_the_rust_backend_with_the_tokenizers_ids() -> None:
    tok = AutoTokenizer.from_pretrained(TINY)
    counting = Counting(tok)
    cache = SegmentCache(counting, backend=tok.backend_tokenizer, verify_every=1 << 30)
    assert cache.enabled
    calls = counting.calls  # the start-up samples are checked against the tokenizer itself
    history = [{"role": "system", "content": "Answer in one line. " * 40}]
    for turn in range(3):
        history.append({"role": "user", "content": f" question {turn}: ünïcödé 12 + {turn}?"})
        text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        assert cache.encode(text) == tok.encode(text, add_special_tokens=False)
        history.append({"role": "assistant", "content": f"because {turn}.\n\n"})
    assert counting.calls == calls  # no piece went through the Python wrapper


def test_the_prompt_tokenizer_gives_its_piece_cache_the_checked_backend() -> None:
    from stages.routing.kv.prompt_tokens import PromptTokenizer

    tokenizer = PromptTokenizer(TINY)
    assert tokenizer.backend is not None
    assert tokenizer._pieces._backend is tokenizer.backend
