"""A decode worker's table rows of KV blocks it did not compute (KV pulled over NIXL): a
signature or an expert event that would read one is unknown, never zeros or the counts of the
block's previous occupant. The ledger and recorder run here as a decode worker inside vLLM's
MultiConnector drives them: the connector learns of a pulled prompt from do_remote_prefill (its
external token count is 0 there) and of the blocks vLLM allocated new from ``admitted``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from stages.capture.ledger import SignatureLedger
from stages.capture.recorder import SignatureRecorder
from stages.routing.kv.block_hashes import external_hash
from stages.signature import wire
from tests.test_capture_parts import FakeMoELayer, end, recorder_with_layers
from tests.test_expert_events import HASHES, _step

Worker = tuple[SignatureLedger, SignatureRecorder, list[FakeMoELayer]]


def decode_worker(publish_blocks: bool = False) -> Worker:
    """Blocks of 4 slots, 2 MoE layers of 4 experts, top-2."""
    recorder, layers = recorder_with_layers(max_tokens=16)
    ledger = SignatureLedger(block_size=4, shape=None, count_decode=False,
                             publish_blocks=publish_blocks)
    return ledger, recorder, layers


def run(worker: Worker, step: SimpleNamespace, picks: list[list[int]], slots: list[int]) -> None:
    """Plan ``step``, run its tokens (``picks``: each token's top-2 in every layer) into
    ``slots``, file the report."""
    ledger, recorder, layers = worker
    recorder.begin_step(ledger.plan(step))
    for layer in layers:
        layer(torch.tensor(picks))
    ledger.apply(end(recorder, torch.tensor(slots)))


def finish(worker: Worker, req_id: str) -> dict:
    ledger = worker[0]
    params = ledger.finished(req_id)
    nothing = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                              num_computed_tokens=[])
    ledger.plan(SimpleNamespace(num_scheduled_tokens={}, finished_req_ids={req_id},
                                scheduled_new_reqs=[], scheduled_cached_reqs=nothing,
                                total_num_scheduled_tokens=0))
    ledger.apply(None)
    return params


def pull_prompt(worker: Worker, blocks: list[int]) -> None:
    """A PD request: its 8-token prompt's KV pulled into ``blocks`` (new to it), then vLLM
    recomputes the last prompt token and the request ends after one output token."""
    worker[0].admitted("pd", blocks, remote=True)  # before the load: do_remote_prefill set
    worker[0].admitted("pd", [], remote=False)  # after it: NIXL cleared it, blocks are cached
    run(worker, _step("pd", 7, 1, blocks, True, 8), [[2, 3]], [blocks[1] * 4 + 3])
    assert finish(worker, "pd") == {}  # a pulled prompt has no signature here


def prefill_locally(worker: Worker) -> dict:
    """The decode worker prefills a 10-token prompt itself that extends the pulled one: blocks
    0 and 1 are a prefix-cache hit, positions 8 and 9 run here (block 2). Every token of the
    prompt picked experts 2 and 3."""
    worker[0].admitted("local", [2], remote=False)
    run(worker, _step("local", 8, 2, [0, 1, 2], True, 10), [[2, 3]] * 2, [8, 9])
    return finish(worker, "local")


def test_a_signature_over_a_pulled_fresh_prefix_is_unknown_not_empty() -> None:
    worker = decode_worker()
    pull_prompt(worker, [0, 1])  # fresh blocks: their rows are zeros
    params = prefill_locally(worker)
    ledger = worker[0]
    assert "eldr_signature" not in params  # was [0, 0, 2, 2] per layer: 2 of 10 tokens
    assert ledger.unknown_signatures == 1
    assert ledger.zero_signatures == 0  # was 1: the PD request's own all-zero snapshot


def test_a_signature_over_a_pulled_reused_block_is_unknown_not_the_previous_occupants() -> None:
    worker = decode_worker()
    # An earlier request this worker computed itself, in blocks 0 and 1: experts 0 and 1.
    worker[0].admitted("old", [0, 1], remote=False)
    run(worker, _step("old", 0, 8, [0, 1], True, 8), [[0, 1]] * 8, list(range(8)))
    assert "eldr_signature" in finish(worker, "old")
    pull_prompt(worker, [0, 1])  # the blocks, evicted, now hold a pulled prompt
    params = prefill_locally(worker)
    assert "eldr_signature" not in params  # was [8, 8, 2, 2]: the old request's counts
    assert worker[0].unknown_signatures == 1


def test_a_block_this_worker_computes_again_from_its_first_slot_is_known_again() -> None:
    worker = decode_worker()
    pull_prompt(worker, [0, 1])
    # Evicted and reused by a prompt this worker computes whole: the rows are reset and right.
    worker[0].admitted("again", [1, 0, 3], remote=False)
    run(worker, _step("again", 0, 10, [1, 0, 3], True, 10), [[2, 3]] * 10,
        [4, 5, 6, 7, 0, 1, 2, 3, 12, 13])
    params = finish(worker, "again")
    assert worker[0].unknown_signatures == 0
    counts = wire.decode(params)
    assert counts is not None
    np.testing.assert_array_equal(counts, [[0, 0, 10, 10]] * 2)


def test_expert_events_leave_out_a_pulled_block_and_count_it() -> None:
    worker = decode_worker(publish_blocks=True)
    ledger = worker[0]
    pull_prompt(worker, [0, 1])
    # A local request whose 8-token prompt is all cached (blocks 0 and 1): vLLM recomputes its
    # last token into block 1, which becomes full in this step: its row is not its counts.
    ledger.track_hashes("hit", list(HASHES[:2]))
    ledger.admitted("hit", [], remote=False)
    plan = ledger.plan(_step("hit", 7, 1, [0, 1], True, 8))
    assert plan.block_snapshots == {}
    assert ledger.unknown_blocks == 1 and ledger.unknown_signatures == 1


def test_a_pulled_prompts_tail_block_is_no_expert_event_after_nixl_clears_the_flag() -> None:
    # vLLM admits a pulled request twice (before and after the load); the second time its
    # do_remote_prefill is already cleared, which must not make its prompt blocks publishable.
    ledger = SignatureLedger(block_size=4, shape=None, count_decode=False, publish_blocks=True)
    ledger.track_hashes("r", list(HASHES), remote_prompt_len=6)
    ledger.admitted("r", [1, 2], remote=True)
    ledger.track_hashes("r", list(HASHES), remote_prompt_len=0)
    ledger.admitted("r", [2], remote=False)
    assert ledger.plan(_step("r", 5, 1, [1, 2], True, 6)).block_snapshots == {}
    # The second block (prompt tokens 4, 5 pulled; 6, 7 decoded here) becomes full.
    assert ledger.plan(_step("r", 6, 2, [], False, 6)).block_snapshots == {}
    plan = ledger.plan(_step("r", 8, 4, [3], False, 6))
    assert plan.block_snapshots == {external_hash(HASHES[2]): 3}


def test_a_pulled_requests_decode_steps_are_counted_not_skipped() -> None:
    """With foreign blocks on the worker (its pulled prompts), a decode step that starts
    inside a block is counted as decode, not skipped as a prefix hit's recomputed token (a
    block index once shadowed the first-step flag, and every such step was skipped: the real
    suite's decode counts came out zero)."""
    ledger = SignatureLedger(block_size=4, shape=None, count_decode=True)
    ledger.admitted("pd", [10, 11, 12], remote=True)
    ledger.admitted("pd", [], remote=False)
    first = ledger.plan(_step("pd", 7, 1, [10, 11, 12], True, 8))  # the last prompt token
    assert first.skip_slots == [11 * 4 + 3] and not first.decode_slots
    ledger.apply(None)
    for position in (8, 9, 10):  # decode tokens, block 12's slots 0-2
        plan = ledger.plan(_step("pd", position, 1, [], False, 8))
        assert plan.skip_slots == [] and plan.decode_slots == {"pd": [12 * 4 + position - 8]}
        ledger.apply(None)
