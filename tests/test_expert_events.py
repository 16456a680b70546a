"""Expert events without an engine: the ledger asks for the rows of blocks that become full, the
recorder returns them, the publisher sends them, and a proxy's index sums a cached prefix."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from stages.capture.expert_events import ExpertEventPublisher
from stages.capture.ledger import SignatureLedger
from stages.capture.messages import StepPlan, StepReport
from stages.errors import EldrError
from stages.routing.kv.block_experts import BlockExperts, ExpertEventsView
from stages.routing.kv.block_hashes import external_hash
from stages.routing.kv.expert_messages import BlockExperts as BlockEvent
from stages.routing.kv.expert_messages import ExpertBatch
from stages.serve.proxy.view.kv_events import KVEventSource, follow_kv_events
from tests.test_capture_parts import end, recorder_with_layers


def _step(req_id: str, start: int, tokens: int, blocks: list[int], new: bool,
          prompt_len: int) -> SimpleNamespace:
    """A scheduler output running ``tokens`` tokens of one request from ``start``."""
    if new:
        news = [SimpleNamespace(req_id=req_id, prompt_token_ids=list(range(prompt_len)),
                                block_ids=(blocks,), num_computed_tokens=start)]
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                 num_computed_tokens=[])
    else:
        news = []
        cached = SimpleNamespace(req_ids=[req_id], new_block_ids=[(blocks,) if blocks else None],
                                 resumed_req_ids=set(), num_computed_tokens=[start])
    return SimpleNamespace(num_scheduled_tokens={req_id: tokens}, finished_req_ids=set(),
                           scheduled_new_reqs=news, scheduled_cached_reqs=cached,
                           total_num_scheduled_tokens=tokens)


HASHES = [b"\x00" * 24 + bytes([i]) * 8 for i in range(1, 6)]  # vLLM's bytes BlockHash form


def test_the_ledger_asks_for_each_block_once_as_it_becomes_full_by_its_hash() -> None:
    ledger = SignatureLedger(block_size=4, shape=None, count_decode=False, publish_blocks=True)
    hashes = list(HASHES[:2])  # vLLM's list, extended as tokens arrive
    ledger.track_hashes("a", hashes)
    # A prompt of 10 tokens in two chunks: 6 then 4. Blocks 0 and 1 are full after them.
    plan = ledger.plan(_step("a", 0, 6, [7, 8], True, 10))
    assert plan.block_snapshots == {external_hash(HASHES[0]): 7}
    plan = ledger.plan(_step("a", 6, 4, [9], False, 10))
    assert plan.block_snapshots == {external_hash(HASHES[1]): 8}
    plan = ledger.plan(_step("a", 10, 1, [], False, 10))  # decode token 11 of 12
    assert plan.block_snapshots == {}
    plan = ledger.plan(_step("a", 11, 1, [], False, 10))  # block 2 full, its hash not yet known
    assert plan.block_snapshots == {}

    rows = np.arange(8, dtype=np.int16).reshape(2, 4)
    ledger.apply(StepReport(block_counts={external_hash(HASHES[0]): rows}))
    assert list(ledger.stored_blocks) == [external_hash(HASHES[0])]


def test_the_ledger_leaves_out_blocks_whose_kv_came_from_elsewhere() -> None:
    ledger = SignatureLedger(block_size=4, shape=None, count_decode=False, publish_blocks=True)
    ledger.track_hashes("r", list(HASHES))
    ledger.mark_remote("r")
    # Prompt of 6 tokens pulled from a prefill worker; decode runs positions 6 and 7.
    plan = ledger.plan(_step("r", 6, 1, [1, 2], True, 6))
    assert plan.block_snapshots == {}
    plan = ledger.plan(_step("r", 7, 1, [], False, 6))
    assert plan.block_snapshots == {}  # block 1 holds prompt tokens this worker never ran
    plan = ledger.plan(_step("r", 8, 4, [3], False, 6))
    assert plan.block_snapshots == {external_hash(HASHES[2]): 3}


def test_a_prompt_nixl_loaded_inside_vllms_multiconnector_is_left_out_too() -> None:
    # MultiConnector tells eldr's connector no external tokens: the connector passes the
    # prompt length it read in the request's do_remote_prefill instead.
    ledger = SignatureLedger(block_size=4, shape=None, count_decode=False, publish_blocks=True)
    ledger.track_hashes("r", list(HASHES), remote_prompt_len=6)
    plan = ledger.plan(_step("r", 5, 1, [1, 2], True, 6))  # vLLM recomputes the last token
    assert plan.block_snapshots == {}
    assert ledger.plan(_step("r", 6, 2, [], False, 6)).block_snapshots == {}
    plan = ledger.plan(_step("r", 8, 4, [3], False, 6))
    assert plan.block_snapshots == {external_hash(HASHES[2]): 3}


def test_the_ledger_asks_for_nothing_unless_publishing() -> None:
    ledger = SignatureLedger(block_size=4, shape=None, count_decode=False)
    ledger.track_hashes("a", list(HASHES))
    assert ledger.plan(_step("a", 0, 8, [1, 2], True, 8)).block_snapshots == {}


def test_the_recorder_returns_the_rows_of_blocks_after_the_steps_tokens() -> None:
    recorder, layers = recorder_with_layers()
    ids = torch.tensor([[0, 1], [0, 2], [3, 1], [0, 1], [2, 3]])
    recorder.begin_step(StepPlan(num_tokens=5, block_snapshots={11: 2}))
    for layer in layers:
        layer(ids)
    report = end(recorder, torch.tensor([8, 9, 10, 11, 12]))  # block 2 full, 3 begun
    expected = np.bincount(ids[:4].flatten().numpy(), minlength=4)
    np.testing.assert_array_equal(report.block_counts[11], np.stack([expected, expected]))
    assert report.signatures == {}


def test_block_counts_travel_in_one_or_two_bytes_and_bad_ones_are_refused() -> None:
    small = np.array([[0, 255], [3, 4]])
    assert len(BlockEvent.of(1, small).counts) == 4
    index = BlockExperts()
    index.stored(1, BlockEvent.of(1, small).table())  # kept at a byte a count
    assert index._blocks[1].dtype == np.uint8
    summed = index.signature_of([1])
    assert summed is not None and summed.dtype == np.int32
    np.testing.assert_array_equal(summed, small)
    large = np.array([[0, 256], [3, 4]])
    event = BlockEvent.of(1, large)
    assert len(event.counts) == 8
    np.testing.assert_array_equal(event.table(), large)
    with pytest.raises(ValueError, match="bytes of counts"):
        BlockEvent(1, 2, 3, b"\x00" * 5).table()


def test_the_index_sums_the_leading_known_blocks_and_forgets_the_least_used() -> None:
    index = BlockExperts(max_blocks=3)
    ones = np.ones((2, 4), dtype=np.int32)
    for h in (1, 2, 3):
        index.stored(h, ones * h)
    assert index.signature_of([9, 1]) is None
    np.testing.assert_array_equal(index.signature_of([1, 2, 7, 3]), ones * 3)
    assert index.leading([1, 2, 3]) == 3
    index.stored(4, ones)  # 1 and 2 were matched since 3 was stored: 3 goes
    assert index.leading([3]) == 0 and index.leading([1, 2, 4]) == 3
    assert index.evicted == 1
    with pytest.raises(ValueError, match="shape"):
        index.stored(5, np.ones((3, 4), dtype=np.int32))
    with pytest.raises(EldrError):
        BlockExperts(max_blocks=0)


def test_the_view_skips_duplicates_and_counts_what_it_cannot_read() -> None:
    import msgspec

    view = ExpertEventsView(2, BlockExperts())
    raw = msgspec.msgpack.encode(ExpertBatch(0.0, [BlockEvent.of(5, np.ones((1, 2)))]))
    view.apply(1, 0, raw)
    view.apply(1, 0, raw)  # the replay and the stream overlap
    view.apply(1, 1, raw)
    view.apply(1, 1, raw)
    assert view.batches.tolist() == [0, 2] and view.last_seq == [None, 1]
    view.apply(1, 0, raw)  # a restarted publisher
    assert view.batches.tolist() == [0, 3] and view.last_seq == [None, 0]
    view.apply(0, 0, b"\x01garbage")
    view.apply(0, 1, msgspec.msgpack.encode(ExpertBatch(0.0, [BlockEvent(6, 2, 2, b"x")])))
    assert view.undecodable.tolist() == [2, 0] and len(view.index) == 1
    view.gap(0, repaired=False)  # a block's counts stay true: nothing is cleared
    assert view.lost.tolist() == [1, 0] and view.index.leading([5]) == 1


def test_a_proxy_follows_the_publisher_with_its_history(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/experts"
    publisher = ExpertEventPublisher(endpoint)
    counts = {h: np.full((2, 3), h, dtype=np.int32) for h in (1, 2, 3)}

    async def follow() -> ExpertEventsView:
        view = ExpertEventsView(1, BlockExperts())
        publisher.publish({1: counts[1]})  # before anyone listens: only the replay brings it
        await asyncio.sleep(0.2)
        task = asyncio.create_task(follow_kv_events([KVEventSource.parse(endpoint)], view))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if len(view.index) >= 1:
                break
        publisher.publish({2: counts[2], 3: counts[3]})
        for _ in range(100):
            await asyncio.sleep(0.05)
            if len(view.index) == 3:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return view

    try:
        view = asyncio.run(follow())
    finally:
        publisher.close()
    np.testing.assert_array_equal(view.index.signature_of([1, 2, 3]), np.full((2, 3), 6))
    assert view.last_seq == [1] and view.undecodable.tolist() == [0]


# --- eldr serve's wiring ---

def test_workers_eldr_serve_starts_for_eldr_kv_publish_on_their_own_endpoints() -> None:
    import json

    from stages.engine import server_command
    from stages.serve.cluster.launcher import Cluster, ClusterSpec
    from tests.test_launcher import free_range

    plain = Cluster(ClusterSpec(model="/m", served_name="m", base_port=free_range(3)))
    assert plain.expert_event_endpoints == [None, None, None]
    assert "publish_experts" not in " ".join(server_command(plain.specs[0])[0])

    cluster = Cluster(ClusterSpec(model="/m", served_name="m", base_port=free_range(3),
                                  expert_events=True))
    endpoints = cluster.expert_event_endpoints
    assert len(set(endpoints)) == 3 and all(e and e.startswith("ipc://") for e in endpoints)
    for spec in cluster.specs:
        argv = server_command(spec)[0]
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        eldr = config["kv_connector_extra_config"]["connectors"][0]
        assert eldr["kv_connector_extra_config"]["publish_experts"] == spec.expert_events


def test_a_proxy_given_expert_events_follows_them_into_its_index(tmp_path) -> None:
    from stages.paths import BUNDLED_MODELS_DIR
    from stages.serve.proxy import create_app
    from stages.serve.proxy.config import KVConfig
    from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker
    from tests.test_proxy import fast_config, wait_until

    with pytest.raises(EldrError, match="1 expert event endpoints for 2 workers"):
        KVConfig(tokenizer="/m", prefill_events=(None,), decode_events=(None,),
                 expert_events=("ipc:///x",))
    endpoint = f"ipc://{tmp_path}/experts"
    publisher = ExpertEventPublisher(endpoint)
    servers = [BackgroundServer(create_fake_worker(FakeBehavior(n)), "critical").start()
               for n in ("p0", "d0")]
    kv = KVConfig(tokenizer=str(BUNDLED_MODELS_DIR / "tiny"), prefill_events=(None,),
                  decode_events=(None,), expert_events=(endpoint, None))
    app = create_app(fast_config([servers[0].url], [servers[1].url], policy="eldr-kv",
                                 model="tiny", kv=kv))
    try:
        with BackgroundServer(app) as proxy:
            publisher.publish({7: np.ones((2, 3), dtype=np.int32)})
            index = app.state.proxy.block_experts.index
            wait_until(lambda: len(index) == 1)
            np.testing.assert_array_equal(index.signature_of([7]), np.ones((2, 3)))
            state = httpx.get(f"{proxy.url}/admin/state", timeout=10).json()["block_experts"]
            assert state["blocks"] == 1 and state["batches"] == [1, 0]
    finally:
        publisher.close()
        for s in servers:
            s.stop()


def test_eldr_serve_turns_expert_events_on_for_eldr_kv_only(monkeypatch, tmp_path) -> None:
    from stages.serve import deploy
    from stages.serve.deploy import ServeOptions, plan
    from tests.conftest import free_port
    from tests.test_launcher import free_range

    # The plan only: no artifact is read (eldr-kv's centroids are not what is tested here).
    monkeypatch.setattr(deploy, "needs_centroids", lambda policy: False)
    experts = {}
    for policy in ("kv", "eldr-kv"):
        serve = plan(ServeOptions(policy=policy, model="tiny", port=free_port(),
                                  worker_port=free_range(3), store=tmp_path / "none"))
        assert serve.proxy.kv is not None
        experts[policy] = serve.proxy.kv.expert_events
    assert experts["kv"] == ()
    assert len(experts["eldr-kv"]) == 3 and None not in experts["eldr-kv"]
