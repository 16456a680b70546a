"""Proxy building blocks without HTTP: prefill hashing, SSE framing, bodies, leases, router."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from stages.errors import EldrError
from stages.routing.policy_config import PolicyConfig
from stages.routing.prefill_router import PrefillRouter
from stages.serve.proxy.config import ProxyConfig
from stages.serve.proxy.front.request import PREFILL_KV_TRANSFER_PARAMS, decode_body, prefill_body
from stages.serve.proxy.legs.sse import IncompleteEvent, is_done, whole_events
from stages.serve.proxy.router.decode_router import DecodeRouter
from stages.serve.proxy.view.workers import WorkerPool
from stages.signature import wire
from tests.fakes.artifact import domain_artifact
from tests.fakes.worker import domain_signature

URLS = [f"http://p{i}:8000" for i in range(4)]


def test_prefill_hash_is_sticky_and_spread() -> None:
    r = PrefillRouter(URLS)
    loads, elig = np.zeros(4, np.int64), np.ones(4, bool)
    keys = [f"prompt {i} ".encode() * 20 for i in range(400)]
    homes = [r.choose(k, loads, elig) for k in keys]
    assert homes == [r.choose(k, loads, elig) for k in keys]
    assert min(Counter(homes).values()) > 50  # 160 virtual nodes spread keys evenly


def test_prefill_hash_uses_first_1024_bytes_only() -> None:
    r = PrefillRouter(URLS)
    prefix = b"x" * 1024
    assert r.home(prefix + b"tail one") == r.home(prefix + b"another tail")


def test_prefill_load_gate_and_eligibility() -> None:
    r = PrefillRouter(URLS)
    key = b"shared system prompt"
    home = r.home(key)
    loads = np.zeros(4, np.int64)
    loads[home] = 3  # capacity = ceil(1.25 * 4 / 4) = 2: home is over the gate
    other = r.choose(key, loads, np.ones(4, bool))
    assert other != home
    elig = np.ones(4, bool)
    elig[home] = False
    assert r.choose(key, np.zeros(4, np.int64), elig) != home


def test_prefill_and_decode_bodies() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 8,
    }
    pre = prefill_body(body, chat=False)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["min_tokens"] == 1
    assert "stream_options" not in pre
    assert pre["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    chat = prefill_body({"messages": [], "max_completion_tokens": 9}, chat=True)
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1
    kv = {"remote_engine_id": "e", "remote_block_ids": [1], **wire.encode(np.ones((2, 3)))}
    dec = decode_body(body, kv)
    assert dec["kv_transfer_params"] == {"remote_engine_id": "e", "remote_block_ids": [1]}
    assert dec["max_tokens"] == 64 and dec["stream"] is True
    assert body.get("kv_transfer_params") is None  # the client's body is not mutated
    assert "kv_transfer_params" not in decode_body({**body, "kv_transfer_params": {}}, None)


async def _collect(chunks: list[bytes]) -> list[bytes]:
    async def gen():
        for c in chunks:
            yield c

    return [b async for b in whole_events(gen())]


@pytest.mark.anyio
async def test_sse_regrouping_forwards_whole_events_only() -> None:
    out = await _collect([b'data: {"a"', b": 1}\n\ndata: {}\n", b"\ndata: [DONE]\n\n"])
    assert b"".join(out) == b'data: {"a": 1}\n\ndata: {}\n\ndata: [DONE]\n\n'
    assert out[0] == b'data: {"a": 1}\n\n'
    assert is_done(out[-1]) and not is_done(out[0])
    with pytest.raises(IncompleteEvent):
        await _collect([b'data: {}\n\ndata: {"trunc'])


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_lease_release_is_idempotent() -> None:
    seen: list[int] = []
    pool = WorkerPool(["http://a", "http://b"], "decode")
    lease = pool.acquire(1, seen.append)
    assert list(pool.loads()) == [0, 1]
    lease.release()
    lease.release()
    assert list(pool.loads()) == [0, 0] and seen == [1]
    pool.mark_unhealthy(0, "test")
    assert list(pool.eligible()) == [False, True]
    assert list(pool.eligible(exclude=[1])) == [False, False]


def test_decode_router_features_and_fallback() -> None:
    art = domain_artifact(3)
    tau0 = PolicyConfig.from_mapping({"eldr": {"tau": 0.0}})
    router = DecodeRouter(3, "eldr", art, policy_config=tau0)
    kv = wire.encode(domain_signature({"prompt": "domain=2"}))
    f = router.features(kv)
    assert not f.missing and f.vector is not None
    assert router.choose(f, np.zeros(3, np.int64), np.ones(3, bool)).worker == 2
    assert router.features({"remote_engine_id": "x"}).missing
    # Wrong [L, E] for this artifact counts as missing rather than being misread.
    assert router.features(wire.encode(np.ones((2, 16), np.int32))).missing
    # An empty signature is a recording failure: missing, routed as without a signature.
    assert router.features(wire.encode(np.zeros((4, 16), np.int32))).missing
    router.set_policy("rr")
    assert not router.features(kv).missing  # signature-blind policies do not look
    with pytest.raises(EldrError):
        router.set_policy("eldr", {"tau": -1})
    assert router.policy_name == "rr"
    with pytest.raises(EldrError, match="2 centroids for 3 decode workers"):
        router.set_artifact(domain_artifact(2))
    router.set_artifact(domain_artifact(4))  # more clusters than workers: spread over them
    assert sorted(len(c) for c in router.clusters_of_worker(np.ones(3, bool))) == [1, 1, 2]


def test_config_validation() -> None:
    ok = ProxyConfig(prefill_urls=["http://p/"], decode_urls=["http://d"], policy="rr")
    assert ok.prefill_urls == ("http://p",)
    with pytest.raises(EldrError):
        ProxyConfig(prefill_urls=(), decode_urls=("http://d",))
    with pytest.raises(EldrError, match="unknown policy"):
        ProxyConfig(prefill_urls=("http://p",), decode_urls=("http://d",), policy="x")
    with pytest.raises(EldrError, match="distinct"):
        ProxyConfig(prefill_urls=("http://p",), decode_urls=("http://d", "http://d"))


def test_build_state_artifact_rules() -> None:
    from stages.serve.proxy.state import build_state

    urls = dict(prefill_urls=("http://p",), decode_urls=("http://d0", "http://d1", "http://d2"))

    def k2(root, version):
        return domain_artifact(2)

    with pytest.raises(EldrError, match="needs an artifact"):
        build_state(ProxyConfig(**urls, policy="eldr"))
    with pytest.raises(EldrError, match="2 centroids for 3 decode workers"):
        build_state(ProxyConfig(**urls, policy="eldr", artifact_store="/a"), artifact_loader=k2)
    # A load-only policy serves even if the store holds a fit for fewer workers.
    state = build_state(ProxyConfig(**urls, policy="jsq", artifact_store="/a"), artifact_loader=k2)
    assert state.router.artifact is None
    with pytest.raises(EldrError, match="needs centroids"):
        state.router.set_policy("eldr")
