"""The conversation workloads: the bundled generator, ShareGPT files, capped histories and the
ideal prefix-hit share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages import paths
from stages.bench.workloads.blocks import block_hashes, cacheable_blocks
from stages.bench.workloads.chat_tokens import HfChatTokenizer
from stages.bench.workloads.conversations import (
    Conversation,
    ConversationSpec,
    History,
    check_fits,
    generate_conversations,
    salted,
)
from stages.bench.workloads.ideal_hits import SentTurn, ideal_hits
from stages.bench.workloads.sharegpt import load_sharegpt
from stages.errors import EldrError
from stages.prompts import load_prompts


@pytest.fixture(scope="module")
def tok() -> HfChatTokenizer:
    return HfChatTokenizer(paths.BUNDLED_MODELS_DIR / "tiny")


@pytest.fixture(scope="module")
def prompts():  # type: ignore[no-untyped-def]
    return load_prompts(paths.EVALUATION_PROMPTS)[:200]


def test_the_bundled_tokenizer_renders_its_chat_template(tok: HfChatTokenizer) -> None:
    assert tok.max_model_len == 2048
    ids = tok.render([{"role": "user", "content": "hello"}])
    assert ids[0] == 0  # <s>
    assert ids[-len(tok.encode("<|assistant|>\n")):] == tok.encode("<|assistant|>\n")


def test_every_run_gets_fresh_conversations(tok: HfChatTokenizer, prompts) -> None:  # type: ignore[no-untyped-def]
    spec = ConversationSpec(conversations=6, turns=3, system_prompts=2, system_tokens=64,
                            message_tokens=32)
    a = generate_conversations(prompts, spec, tok, seed=0, salt="run-a")
    b = generate_conversations(prompts, spec, tok, seed=0, salt="run-b")
    assert generate_conversations(prompts, spec, tok, seed=0, salt="run-a") == a
    assert len(a) == 6 and all(len(c.user_messages) == 3 for c in a)
    # Two system prompts shared by the run's conversations, none shared across runs, and no
    # first block in common between the runs' prompts: a worker's cache holds nothing of the
    # other run's.
    assert len({c.system for c in a}) == 2
    assert not {c.system for c in a} & {c.system for c in b}
    first_block = {block_hashes(tok.render([{"role": "system", "content": c.system}]), 32)[0]
                   for c in a}
    assert not first_block & {block_hashes(tok.render(
        [{"role": "system", "content": c.system}]), 32)[0] for c in b}
    for c in a:
        assert len(tok.encode(c.system)) <= 64
        assert all(len(tok.encode(m)) <= 32 + 1 for m in c.user_messages)


def test_history_holds_the_real_answers_and_stays_below_the_models_length(
    tok: HfChatTokenizer,
) -> None:
    conversation = Conversation("c", "system text", ("one " * 300, "two " * 300, "three " * 300))
    history = History(conversation, tok, max_tokens=64)
    budget = tok.max_model_len - 64
    messages, ids = history.messages_for(0)
    assert len(ids) <= budget
    history.answered(0, "the real answer " * 100)
    messages, ids = history.messages_for(1)
    assert {"role": "assistant", "content": "the real answer " * 100} in messages
    assert len(ids) <= budget
    history.answered(1, "second answer " * 150)
    messages, ids = history.messages_for(2)
    # The third turn would pass the model's length: the oldest pair went, the system stayed.
    assert len(ids) <= budget
    assert history.dropped_pairs >= 1
    assert messages[0] == {"role": "system", "content": "system text"}
    assert messages[-1]["content"] == "three " * 300


def test_a_first_turn_that_cannot_fit_is_refused(tok: HfChatTokenizer) -> None:
    check_fits(ConversationSpec(system_tokens=256, message_tokens=128), 64, 2048)
    with pytest.raises(EldrError, match="lower --system-tokens"):
        check_fits(ConversationSpec(system_tokens=1800, message_tokens=200), 64, 2048)
    history = History(Conversation("c", "", ("word " * 5000,)), tok, max_tokens=64)
    with pytest.raises(EldrError, match="no history"):
        history.messages_for(0)


def test_sharegpt_file_loads_human_turns(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"id": "x", "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
            {"from": "human", "value": "more"}]},
        {"conversations": [{"from": "gpt", "value": "only the assistant"}]},
    ]))
    loaded = load_sharegpt(path)
    assert loaded == [Conversation("x", "be brief", ("hi", "more"))]
    assert salted(loaded, "r1")[0].system.startswith("Session r1.")


@pytest.mark.parametrize(("content", "message"), [
    ("not json", "is not JSON"),
    ('{"conversations": []}', "expected a JSON list"),
    ('[{"turns": []}]', r"sg.json\[0\]: expected an object with a 'conversations' list"),
    ('[{"conversations": [{"from": "human"}]}]', r"conversations\[0\]: expected"),
    ('[{"conversations": [{"from": "robot", "value": "x"}]}]', "unknown speaker 'robot'"),
    ('[{"conversations": [{"from": "gpt", "value": "x"}]}]', "no conversation with 1"),
])
def test_a_bad_sharegpt_file_is_a_clear_error(tmp_path: Path, content: str,
                                              message: str) -> None:
    path = tmp_path / "sg.json"
    path.write_text(content)
    with pytest.raises(EldrError, match=message):
        load_sharegpt(path)
    with pytest.raises(EldrError, match="does not exist"):
        load_sharegpt(tmp_path / "missing.json")


def test_block_hashes_chain_on_the_prefix() -> None:
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2  # the partial last block is not a block
    assert block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == a[0]
    # Equal tokens after a different prefix are a different block.
    assert block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != a[1]
    assert cacheable_blocks(8, 4) == 1 and cacheable_blocks(9, 4) == 2


def test_ideal_hits_count_the_previous_turns_whole_blocks() -> None:
    system = list(range(100, 108))  # 8 tokens: two blocks of 4
    t1 = SentTurn(tuple([*system, 1, 2, 3]), answer_ids=(50, 51, 52, 53, 54))
    # Turn 2 = turn 1's prompt + its answer + a new message.
    t2 = SentTurn(tuple([*system, 1, 2, 3, 50, 51, 52, 53, 54, 7, 7, 7, 7]))
    other = SentTurn(tuple([*system, 9, 9, 9]))  # another conversation, same system prompt
    hits = ideal_hits([t1, other, t2], block_size=4)
    assert hits.prompt_tokens == 11 + 11 + 20
    # t1: nothing cached; other: the system prompt's 2 blocks; t2 with answers: its history
    # is 16 tokens = 4 blocks; without answers (a prefill worker) 2 blocks + nothing past the
    # prompt, since block 3 (tokens 8-11) mixes the prompt's tail with the answer.
    assert hits.history_hit_tokens == 0 + 8 + 16
    assert hits.prefill_hit_tokens == 0 + 8 + 8
    # A prompt is never a full hit: vLLM computes its last token.
    again = ideal_hits([t1, SentTurn(t1.prompt_ids[:8])], block_size=4)
    assert again.prefill_hit_tokens == 4
