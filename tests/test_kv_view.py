"""KV-cache-aware routing's view of the workers: block hashes as vLLM computes them, the block
index, the events that feed it (vLLM's own publisher), and a proxy that routes by them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import msgspec
import numpy as np
import pytest

from stages.errors import EldrError
from stages.paths import BUNDLED_MODELS_DIR
from stages.routing.kv.block_hashes import BlockHasher, external_hash
from stages.routing.kv.block_index import BlockIndex
from stages.routing.kv.endpoints import replay_endpoint
from stages.serve.proxy import create_app
from stages.serve.proxy.config import KVConfig
from stages.serve.proxy.view.kv_events import KVEventSource, KVView, follow_kv_events
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker
from tests.test_proxy import fast_config, wait_until

ENCODE = msgspec.msgpack.Encoder()


def stored(hashes: list[int], block_size: int = 4) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": [], "block_size": block_size, "lora_id": None, "medium": "GPU",
            "lora_name": None}


def batch(*events: dict) -> bytes:
    return ENCODE.encode([0.0, list(events), None])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- hashes ---

def test_only_full_blocks_are_hashed_and_each_depends_on_all_before_it() -> None:
    hasher = BlockHasher("sha256")
    a = hasher.hashes(list(range(10)), 4)
    b = hasher.hashes([*range(4), 99, *range(5, 10)], 4)
    assert len(a) == 2  # 10 tokens: two full blocks, the partial third is never cached
    assert a[0] == b[0] and a[1] != b[1]
    assert all(0 <= h < 2**64 for h in a)


def test_a_cache_salt_keys_the_first_block_and_so_every_block() -> None:
    hasher = BlockHasher("sha256")
    plain, salted = hasher.hashes(list(range(8)), 4), hasher.hashes(list(range(8)), 4, "s")
    assert plain[0] != salted[0] and plain[1] != salted[1]


def test_blocks_hashed_before_come_from_the_memo_and_equal_a_fresh_hash() -> None:
    tokens = list(range(1000))
    memo = BlockHasher("sha256", max_memo=40)
    first = memo.hashes(tokens, 16)
    assert memo.hashes(tokens, 16) == first == BlockHasher("sha256").hashes(tokens, 16)
    assert memo.hashes([*tokens, 5, 6], 16)[:62] == first[:62]
    assert len(memo._memo) <= 40 + 64  # cleared once past its bound, refilled by one prompt


def test_event_hashes_in_bytes_read_as_the_default_int_form() -> None:
    raw = bytes(range(32))
    assert external_hash(raw) == int.from_bytes(raw, "big") & (2**64 - 1)
    assert external_hash(2**70 + 5) == 5


def test_xxhash_without_a_shared_seed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(EldrError, match="PYTHONHASHSEED"):
        BlockHasher("xxhash")
    with pytest.raises(EldrError, match="unknown"):
        BlockHasher("md5")


def test_the_hashes_are_vllms_own() -> None:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    for algo in ("sha256", "sha256_cbor"):
        fn = get_hash_fn_by_name(algo)
        kv_cache_utils.init_none_hash(fn)
        tokens, parent, want = list(range(500, 650)), None, []
        for start in range(0, 128, 32):
            extra = (("cache_salt", "x"),) if start == 0 else None
            parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[start:start + 32], extra)
            want.append(external_hash(parent))
        assert BlockHasher(algo).hashes(tokens, 32, "x") == want


# --- the index ---

def test_a_worker_reuses_only_the_run_of_leading_blocks_it_holds() -> None:
    index = BlockIndex(3)
    index.stored(0, [1, 2, 3])
    index.stored(1, [1, 3])  # holds 3 but not 2: a hit stops at the first block it lacks
    index.stored(2, [9])
    assert index.leading_blocks([1, 2, 3]).tolist() == [3, 1, 0]
    index.removed(0, [2, 7])  # 7 never stored here: ignored
    assert index.leading_blocks([1, 2, 3]).tolist() == [1, 1, 0]
    index.cleared(1)
    assert index.leading_blocks([1, 2, 3]).tolist() == [1, 0, 0]
    assert index.held(1) == 0 and index.held(0) == 2


def test_leading_runs_and_whole_holds_match_a_block_by_block_count() -> None:
    rng = np.random.default_rng(7)
    for _ in range(300):
        workers = int(rng.integers(1, 9))
        index = BlockIndex(workers)
        held = [set(rng.choice(12, size=int(rng.integers(0, 12)), replace=False).tolist())
                for _ in range(workers)]
        for w, blocks in enumerate(held):
            index.stored(w, blocks)
        hashes = rng.integers(0, 12, size=int(rng.integers(0, 10))).tolist()
        runs = []
        for blocks in held:
            run = 0
            while run < len(hashes) and hashes[run] in blocks:
                run += 1
            runs.append(run)
        assert index.leading_blocks(hashes).tolist() == runs
        assert [index.holds_all(w, hashes) for w in range(workers)] == [
            set(hashes) <= blocks for blocks in held]


# --- the view ---

def test_events_fill_the_view_and_a_restart_empties_it() -> None:
    view = KVView(2)
    view.apply(0, 0, batch(stored([10, 11])))
    view.apply(1, 0, batch(stored([10])))
    assert view.block_size == 4
    assert view.cached_tokens([10, 11]).tolist() == [8, 4]
    view.apply(0, 1, batch({"type": "BlockRemoved", "block_hashes": [11], "medium": None}))
    view.apply(0, 1, batch(stored([11])))  # a duplicate (replay overlapping the stream)
    assert view.cached_tokens([10, 11]).tolist() == [4, 4]
    view.apply(1, 0, batch(stored([50])))  # numbers started over: a new engine
    assert view.cached_tokens([10]).tolist() == [4, 0]
    view.apply(0, 2, batch({"type": "AllBlocksCleared"}))
    assert view.cached_tokens([10]).tolist() == [0, 0]


def test_a_worker_that_owes_events_or_sends_garbage_is_untrusted_until_it_publishes() -> None:
    clock = Clock()
    view = KVView(2, silent_after_s=5.0, clock=clock)
    view.apply(0, 0, batch(stored([1, 2])))
    view.apply(1, 0, batch(stored([1, 2])))
    view.sent(0, [1, 2])  # holds both: stores nothing, owes nothing
    view.sent(1, [1, 2, 3])  # lacks block 3: its BlockStored must follow
    clock.now = 6.0
    assert view.trusted().tolist() == [True, False]
    assert view.cached_tokens([1, 2]).tolist() == [8, 0]  # routed on load alone
    view.apply(1, 1, batch(stored([3])))
    assert view.trusted().tolist() == [True, True]
    view.apply(0, 1, b"\x00not msgpack")
    assert view.undecodable[0] == 1 and view.trusted()[0]  # within the bound
    clock.now = 12.0
    assert not view.trusted()[0]
    assert view.state()[0]["trusted"] is False


def test_a_prompt_matched_from_its_head_alone_owes_events_whatever_its_worker_holds() -> None:
    clock = Clock()
    view = KVView(2, silent_after_s=5.0, clock=clock)
    view.apply(0, 0, batch(stored([1, 2])))
    view.apply(1, 0, batch(stored([1, 2])))
    # No blocks known (held nowhere) or only the held ones: its new blocks will be stored.
    view.sent(0, [], unhashed=True)
    view.sent(1, [1, 2], unhashed=True)
    clock.now = 6.0
    assert view.trusted().tolist() == [False, False]  # a stream that died is found out


def test_a_block_size_below_one_is_refused_with_its_batch() -> None:
    view = KVView(1)
    view.apply(0, 0, batch(stored([1], block_size=0)))
    assert view.undecodable[0] == 1 and view.block_size is None and view.index.held(0) == 0
    view.apply(0, 0, batch(stored([1], block_size=16)))
    assert view.block_size == 16 and view.index.held(0) == 1


def test_a_gap_the_replay_cannot_fill_clears_the_workers_blocks() -> None:
    view = KVView(1)
    view.apply(0, 0, batch(stored([1])))
    view.gap(0, repaired=True)
    assert view.cached_tokens([1]).tolist() == [4]
    view.gap(0, repaired=False)
    assert view.cached_tokens([1]).tolist() == [0]
    assert (view.gaps[0], view.lost[0]) == (2, 1)


def test_an_index_past_its_bound_starts_over_and_is_counted() -> None:
    """A publisher that never sends removals would grow the index with every prompt its worker
    ever ran; past the bound the index starts over (a hit lost, not the proxy's memory)."""
    view = KVView(2, max_blocks=4)
    view.apply(0, 0, batch(stored([1, 2, 3])))
    view.apply(1, 0, batch(stored([1, 2, 3, 4])))  # at the bound: kept
    view.apply(0, 1, batch(stored([4, 5])))
    assert view.cached_tokens([1]).tolist() == [0, 4]
    assert view.overflows.tolist() == [1, 0] and view.state()[0]["overflows"] == 1
    view.apply(0, 2, batch(stored([6])))  # rebuilt from what follows
    assert view.index.held(0) == 1 and view.trusted().all()


def test_endpoints_follow_eldrs_replay_convention() -> None:
    assert replay_endpoint("tcp://*:5700") == "tcp://*:5701"
    assert replay_endpoint("ipc:///run/kv0") == "ipc:///run/kv0.replay"
    assert KVEventSource.parse("tcp://*:5700").endpoint == "tcp://127.0.0.1:5700"
    with pytest.raises(EldrError, match="tcp://HOST:PORT"):
        replay_endpoint("http://d0:5700")


# --- vLLM's own publisher ---

def test_the_view_follows_vllms_publisher_with_its_history_and_gaps(tmp_path) -> None:
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import (
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    endpoint = f"ipc://{tmp_path}/ev"
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                            replay_endpoint=replay_endpoint(endpoint), topic="kv")
    publisher = ZmqEventPublisher(data_parallel_rank=0, **{
        k: getattr(config, k) for k in ("endpoint", "replay_endpoint", "buffer_steps", "hwm",
                                        "max_queue_size", "topic")})

    def publish(hashes: list[int]) -> None:
        publisher.publish(KVEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
            lora_id=None, medium="GPU", lora_name=None)]))

    async def follow() -> KVView:
        view = KVView(1)
        publish([1])  # before anyone listens: only the replay brings it
        await asyncio.sleep(0.2)
        task = asyncio.create_task(follow_kv_events([KVEventSource.parse(endpoint)], view))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if view.index.held(0) >= 1:
                break
        publish([2])
        publish([3])
        for _ in range(100):
            await asyncio.sleep(0.05)
            if view.index.held(0) == 3:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return view

    try:
        view = asyncio.run(follow())
    finally:
        publisher.shutdown()
    assert view.cached_tokens([1, 2, 3]).tolist() == [48]
    assert view.last_seq[0] == 2


# --- the proxy ---

@pytest.fixture
def kv_proxy() -> Iterator[tuple[object, list[FakeBehavior], httpx.Client]]:
    behaviors = [FakeBehavior(n) for n in ("p0", "p1", "d0", "d1")]
    servers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    kv = KVConfig(tokenizer=str(BUNDLED_MODELS_DIR / "tiny"), prefill_events=(None, None),
                  decode_events=(None, "ipc:///nowhere/d1"))
    config = fast_config([s.url for s in servers[:2]], [s.url for s in servers[2:]],
                         policy="eldr-kv", model="tiny", kv=kv)
    app = create_app(config)
    try:
        with BackgroundServer(app) as proxy, httpx.Client(base_url=proxy.url,
                                                          timeout=10) as client:
            yield app.state.proxy, behaviors, client
    finally:
        for s in servers:
            s.stop()


def test_the_proxy_sends_both_legs_to_the_workers_holding_the_prompt(kv_proxy) -> None:
    state, behaviors, client = kv_proxy
    assert client.post("/admin/policy", json={"policy": "eldr-kv",
                                              "config": {"local_prefill_below": 0}}).is_success
    kv = state.kv
    prompt = "The committee reviewed the annual report on water quality. " * 30
    ids = kv.tokenizer.completion({"prompt": prompt})
    hashes = BlockHasher().hashes(ids, 32)
    # Prefill worker 1 and decode worker 0 hold the prompt; the others hold nothing.
    kv.prefill.apply(1, 0, batch(stored(hashes, block_size=32)))
    kv.decode.apply(0, 0, batch(stored(hashes, block_size=32)))
    for _ in range(3):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8})
        assert r.status_code == 200, r.text
    assert [len(b.received) for b in behaviors] == [0, 3, 3, 0]
    cached = state.metrics.registry.get_sample_value("eldr_kv_cached_tokens_total",
                                                     {"leg": "prefill"})
    assert cached == 3 * ((len(ids) - 1) // 32) * 32
    snapshot = client.get("/admin/state").json()["kv"]
    assert snapshot["prefill"][1]["blocks"] == len(hashes) and snapshot["prefill"][1]["trusted"]
    assert [w["endpoint"] for w in snapshot["decode"]] == [None, "ipc:///nowhere/d1"]
    assert snapshot["block_size"] == 32
    page = client.get("/metrics").text
    assert "eldr_kv_index_trusted" in page
    assert 'eldr_kv_index_overflows_total{role="decode",worker="decode-0"} 0.0' in page
    wait_until(lambda: int(np.sum(state.kv.prefill_queued)) == 0)


def test_a_prompt_it_cannot_reproduce_is_routed_without_kv(kv_proxy) -> None:
    state, _, client = kv_proxy
    state.kv.prefill.apply(0, 0, batch(stored([1], block_size=32)))  # block size known
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert state.metrics.registry.get_sample_value(
        "eldr_kv_prompt_tokens_total", {"leg": "prefill"}) in (None, 0.0)


def _local_prefill(client: httpx.Client) -> None:
    assert client.post("/admin/policy", json={"policy": "eldr-kv",
                                              "config": {"local_prefill_below": 512}}).is_success


def test_a_decode_worker_holding_nearly_all_the_prompt_prefills_it_itself(kv_proxy) -> None:
    state, behaviors, client = kv_proxy
    _local_prefill(client)
    kv = state.kv
    history = "The committee reviewed the annual report on water quality. " * 30
    prompt = history + "What changed since last year?"
    hashes = BlockHasher().hashes(kv.tokenizer.completion({"prompt": history}), 32)
    kv.prefill.apply(0, 0, batch(stored(hashes, block_size=32)))
    kv.decode.apply(1, 0, batch(stored(hashes, block_size=32)))  # the conversation's worker
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert [len(b.received) for b in behaviors] == [0, 0, 0, 1]  # no prefill, no hand-off
    sent = behaviors[3].received[0].body
    assert sent["prompt"] == prompt and "do_remote_prefill" not in sent.get(
        "kv_transfer_params", {})
    assert state.metrics.registry.get_sample_value("eldr_router_local_prefills_total") == 1
    # Asked for far more than it holds, the same worker gets the PD path.
    r = client.post("/v1/completions", json={"prompt": prompt * 4, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert sum(len(b.received) for b in behaviors[:2]) == 1
    wait_until(lambda: state.decode.loads().sum() == 0)


def test_a_local_prefill_that_fails_takes_the_pd_path(kv_proxy) -> None:
    state, behaviors, client = kv_proxy
    _local_prefill(client)
    kv = state.kv
    prompt = "The committee reviewed the annual report on water quality. " * 30
    hashes = BlockHasher().hashes(kv.tokenizer.completion({"prompt": prompt}), 32)
    kv.decode.apply(0, 0, batch(stored(hashes, block_size=32)))
    behaviors[2].fail_status = 503  # decode worker 0 answers 503 to anything
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert len(behaviors[2].received) == 1  # tried locally first
    assert sum(len(b.received) for b in behaviors[:2]) == 1  # then prefilled remotely
    assert len(behaviors[3].received) == 1  # and decoded on the other worker


def replay_to_follower(tmp_path, batches, done) -> tuple[KVView, int]:  # type: ignore[no-untyped-def]
    """A follower of one worker whose replay socket answers with ``batches`` ((seq, payload)
    pairs) then the end marker; the view once ``done(view)`` holds (up to 20 s on a loaded
    machine) and the start number the follower asked the replay from."""
    import zmq
    import zmq.asyncio

    endpoint = f"ipc://{tmp_path}/ev"

    async def follow() -> tuple[KVView, int]:
        context = zmq.asyncio.Context.instance()
        router = context.socket(zmq.ROUTER)
        router.bind(replay_endpoint(endpoint))
        view = KVView(1)
        task = asyncio.create_task(follow_kv_events([KVEventSource.parse(endpoint)], view))
        assert not view.replied[0]
        identity, _, start = await router.recv_multipart()
        for seq, payload in batches:
            await router.send_multipart((identity, b"", b"kv", seq.to_bytes(8, "big"), payload))
        await router.send_multipart((identity, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                     b""))
        for _ in range(1000):
            await asyncio.sleep(0.02)
            if done(view):
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close(linger=0)
        return view, int.from_bytes(start, "big")

    return asyncio.run(follow())


def test_a_replay_that_skips_batches_starts_the_workers_index_over(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A ROUTER drops what a full pipe cannot take: batches missing inside a replay may have
    removed blocks, so the index keeps only what follows the hole."""
    # Batch 2 (which removed block 1) never arrives.
    batches = ((0, batch(stored([1, 2], block_size=16))), (1, batch(stored([3], block_size=16))),
               (3, batch(stored([4], block_size=16))))
    view, start = replay_to_follower(tmp_path, batches, lambda view: view.last_seq[0] == 3)
    assert start == 0
    assert view.last_seq[0] == 3
    assert view.lost[0] == 1
    assert view.index.held(0) == 1  # block 4 only: 1-3 were known before the hole


def test_a_replay_that_answers_with_nothing_marks_the_stream_heard(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A worker that stored no block yet replays nothing: its answer still tells the follower
    the stream is known (readiness stops waiting for it), and no batch is counted."""
    view, _ = replay_to_follower(tmp_path, (), lambda view: view.replied[0])
    assert view.replied[0] and view.last_seq[0] is None and view.events[0] == 0
