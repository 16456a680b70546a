"""A prompt that starts like no first block the workers hold is matched without tokenizing; one
that does, or any prompt where ruling out would not be sound, is tokenized as before."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from stages.paths import BUNDLED_MODELS_DIR, CALIBRATION_PROMPTS, EVALUATION_PROMPTS
from stages.prompts import load_prompts
from stages.routing.kv.block_hashes import BlockHasher
from stages.routing.kv.event_messages import decode_batch
from stages.routing.kv.first_block_texts import FirstBlockTexts
from stages.serve.proxy.config import KVConfig
from stages.serve.proxy.view.kv_routing import KVRouting

BLOCK = 16
ENCODE = msgspec.msgpack.Encoder()


def _stored(hashes: list[int], ids: list[int], parent: int | None = None) -> bytes:
    """A batch of one BlockStored as vLLM publishes it, token ids included."""
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
             "token_ids": ids, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
             "lora_name": None}
    return ENCODE.encode([0.0, [event], None])


@pytest.fixture
def kv() -> KVRouting:
    return KVRouting(KVConfig(str(BUNDLED_MODELS_DIR / "tiny"), (None,), (None,)))


def _ids(kv: KVRouting, body: dict[str, Any], chat: bool) -> list[int]:
    ids = kv.tokenizer.chat(body) if chat else kv.tokenizer.completion(body)
    assert ids is not None
    return ids


def _prompts() -> list[str]:
    return [p.prompt for path in (CALIBRATION_PROMPTS, EVALUATION_PROMPTS)
            for p in load_prompts(path)][::10]


def _body(text: str, chat: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}


@pytest.mark.parametrize("chat", [False, True])
def test_a_held_first_block_is_never_ruled_out_in_any_bundled_language(kv, chat) -> None:
    texts = kv.first_texts
    assert texts is not None and texts.enabled
    for block in (BLOCK, 128):
        for text in _prompts():
            body = _body(text, chat)
            ids = _ids(kv, body, chat)
            if len(ids) < block:
                continue
            texts.stored(ids[:block], block)
            rendered = kv.tokenizer.render(body, chat)
            assert rendered is not None and rendered.text is not None
            assert texts.may_be_held(rendered.text), text[:60]


def test_a_prompt_no_first_block_starts_is_matched_without_tokenizing(kv, monkeypatch) -> None:
    system = "You answer from the water board's reports, citing the district. " * 4
    held = {"prompt": system + "Which wells were tested? " * 40}
    ids = _ids(kv, held, chat=False)
    hashes = BlockHasher().hashes(ids, BLOCK)
    kv.prefill.apply(0, 0, _stored(hashes, ids[:len(hashes) * BLOCK]))
    encoded: list[int] = []
    backend = kv.tokenizer.backend
    original = backend.encode

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(backend, name)

        def encode(self, text: str, **kwargs: Any) -> Any:
            encoded.append(len(text))
            return original(text, **kwargs)

    monkeypatch.setattr(kv.tokenizer, "_backend", Spy())
    new = "An unrelated question about the river crossings survey. " * 40
    prompt = kv.prompt({"prompt": new}, chat=False)
    assert prompt is not None and prompt.hashes == [] and encoded == []
    assert prompt.unhashed  # its worker will store blocks the proxy cannot name
    whole = len(_ids(kv, {"prompt": new}, chat=False))
    assert abs(prompt.tokens - whole) <= 0.3 * whole  # from its length in characters
    # One that starts as the held prompt does is tokenized and matched.
    same_start = kv.prompt({"prompt": system + "Which districts failed? " * 40}, chat=False)
    assert same_start is not None and encoded
    assert not same_start.unhashed  # encoded whole: every block named
    assert kv.prefill.cached_tokens(same_start.reusable).tolist()[0] > 0


def test_events_without_token_ids_turn_ruling_out_off(kv) -> None:
    texts = kv.first_texts
    assert texts is not None
    kv.prefill.apply(0, 0, _stored([1, 2], []))
    assert not texts.enabled
    assert texts.may_be_held("anything at all, it is tokenized and matched")


def test_unreadable_token_ids_turn_ruling_out_off_and_leave_the_blocks_applied(kv) -> None:
    texts = kv.first_texts
    assert texts is not None
    event = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
             "token_ids": ["not", "ids"] * BLOCK, "block_size": BLOCK}
    kv.prefill.apply(0, 0, ENCODE.encode([0.0, [event], None]))
    assert not texts.enabled and kv.prefill.index.held(0) == 2


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("block", [BLOCK, 128])
def test_a_first_block_read_from_its_event_keys_as_its_whole_ids_do(kv, chat, block) -> None:
    # An event carries every stored block's ids; only the first block's first ids are read,
    # and the whole block only where they decode shorter than a key (CJK at 16 tokens).
    backend, specials = kv.tokenizer.backend, kv.tokenizer.head_specials
    whole, from_events = FirstBlockTexts(backend, specials), FirstBlockTexts(backend, specials)
    texts = [kv.tokenizer.render(_body(text, chat), chat) for text in _prompts()]
    for text in _prompts():
        ids = _ids(kv, _body(text, chat), chat)
        full = len(ids) // block * block
        if not full:
            continue
        whole.stored(ids[:block], block)
        event = {"type": "BlockStored", "block_hashes": BlockHasher().hashes(ids, block),
                 "parent_block_hash": None, "token_ids": ids[:full], "block_size": block}
        from_events.stored_event(decode_batch(ENCODE.encode([0.0, [event], None])).events[0])
    assert from_events._keys.keys() == whole._keys.keys()
    assert from_events._short == whole._short
    assert all(r is not None and r.text is not None and from_events.may_be_held(r.text)
               for r in texts)


def test_later_blocks_events_add_no_first_block(kv) -> None:
    texts = kv.first_texts
    assert texts is not None
    ids = _ids(kv, {"prompt": "The annual report on water quality. " * 20}, chat=False)
    kv.prefill.apply(0, 0, _stored([5], ids[BLOCK:2 * BLOCK], parent=4))
    assert texts.enabled and not texts.may_be_held("The annual report on water quality.")


def test_a_tokenizer_whose_decoding_is_not_its_text_never_rules_out() -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(_prompts()[:50], trainers.BpeTrainer(vocab_size=500,
                                                                 special_tokens=["<unk>"]))
    texts = FirstBlockTexts(tok)
    assert not texts.enabled and texts.may_be_held("Nothing Is Ruled Out")
