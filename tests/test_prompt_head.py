"""A prompt whose first block no worker holds is matched from its head alone: its first
block's ids are the whole prompt's, and nothing more of it is encoded."""

from __future__ import annotations

import pytest

from stages.paths import BUNDLED_MODELS_DIR, CALIBRATION_PROMPTS, EVALUATION_PROMPTS
from stages.prompts import load_prompts
from stages.routing.kv.block_hashes import BlockHasher
from stages.serve.proxy.config import KVConfig
from stages.serve.proxy.view.kv_routing import HEAD_CHARS_PER_TOKEN, KVRouting
from tests.test_kv_view import batch, stored

BLOCK = 16


@pytest.fixture(scope="module")
def kv() -> KVRouting:
    routing = KVRouting(KVConfig(str(BUNDLED_MODELS_DIR / "tiny"), (None,), (None,)))
    routing.prefill.apply(0, 0, batch(stored([1], block_size=BLOCK)))  # the block size
    return routing


def test_a_heads_first_block_is_the_whole_prompts_in_every_bundled_language(kv) -> None:
    prompts = [p.prompt for path in (CALIBRATION_PROMPTS, EVALUATION_PROMPTS)
               for p in load_prompts(path)]
    assert len(prompts) > 50
    tok = kv.tokenizer
    for text in prompts:
        for chat in (False, True):
            body = ({"messages": [{"role": "user", "content": text}]} if chat
                    else {"prompt": text})
            rendered = tok.render(body, chat)
            head = tok.head_ids(rendered, HEAD_CHARS_PER_TOKEN * BLOCK)
            full = tok.ids(rendered)
            assert head[:BLOCK] == full[:BLOCK], text[:60]


def test_a_prompt_nobody_holds_is_not_encoded_past_its_head(kv, monkeypatch) -> None:
    text = "The committee reviewed the annual report on water quality. " * 40
    whole = kv.tokenizer.completion({"prompt": text})
    encoded: list[str] = []
    for encoder in (kv.tokenizer._pieces, kv.texts):
        original = encoder.encode
        monkeypatch.setattr(encoder, "encode",
                            lambda t, original=original: encoded.append(t) or original(t))
    prompt = kv.prompt({"prompt": text}, chat=False)
    assert prompt is not None and prompt.hashes == [] and not encoded
    assert abs(prompt.tokens - len(whole)) <= 0.1 * len(whole)  # estimated from the head
    assert kv.prefill.cached_tokens(prompt.reusable).tolist() == [0]
    # Asked for every id (the signature at arrival), it encodes it all.
    exact = kv.prompt({"prompt": text}, chat=False, all_ids=True)
    assert exact is not None and list(exact.ids) == whole and encoded


def test_a_prompt_whose_first_block_is_held_is_matched_in_full(kv) -> None:
    text = "Shared system prompt, then a question about the water report. " * 40
    ids = kv.tokenizer.completion({"prompt": text})
    hashes = BlockHasher().hashes(ids, BLOCK)
    kv.decode.apply(0, 0, batch(stored(hashes[:3], block_size=BLOCK)))
    prompt = kv.prompt({"prompt": text}, chat=False)
    assert prompt is not None and prompt.hashes == hashes and prompt.tokens == len(ids)
    assert kv.decode.cached_tokens(prompt.reusable).tolist() == [3 * BLOCK]


def test_a_heads_first_block_is_encoded_once(kv, monkeypatch) -> None:
    text = "A system prompt shared by many requests, then their own words. " * 40
    kv.prompt({"prompt": text + "first"}, chat=False)
    heads: list[int] = []
    original = kv.tokenizer.head_ids
    monkeypatch.setattr(kv.tokenizer, "head_ids",
                        lambda rendered, chars: heads.append(chars) or original(rendered, chars))
    second = kv.prompt({"prompt": text + "second"}, chat=False)
    assert second is not None and second.hashes == [] and heads == []
    # Another salt is another first block.
    assert kv.prompt({"prompt": text + "third", "cache_salt": "s"}, chat=False) is not None
    assert len(heads) == 1
