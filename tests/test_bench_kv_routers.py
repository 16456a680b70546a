"""examples/bench_kv_routers.py finds vllm-router where `pip install vllm-router` put it, and
prices eldr's policies with the measured engine cost."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from examples.bench_kv_routers import _priced_by, find_vllm_router


def test_vllm_router_is_found_beside_the_interpreter_when_path_lacks_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    router = tmp_path / "vllm-router"
    router.write_text("#!/bin/sh\n")
    router.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert find_vllm_router() == str(router)
    router.unlink()
    assert find_vllm_router() is None


def test_the_measured_cost_prices_every_policy_that_takes_one_and_overrides_no_user_choice(
        ) -> None:
    cost = Path("/tmp/cost-model.json")
    config = json.loads(_priced_by(
        cost, '{"eldr-union": {"cost": "cpu"}, "eldr-kv": {"load_slack": 0.5}}',
        "eldr-kv,eldr-union,eldr,jsq", ['arrival=kv:{"decode_choice": "arrival"}']))
    # The user's own cost stays; eldr (the paper's rule) and jsq take none.
    assert config == {"eldr-kv": {"load_slack": 0.5, "cost": str(cost)},
                      "eldr-union": {"cost": "cpu"}, "kv": {"cost": str(cost)}}


def test_engine_cost_without_an_artifact_says_how_to_get_one(tmp_path: Path) -> None:
    from examples.bench_kv_routers import _engine_cost

    with pytest.raises(SystemExit, match="--capture N, or --home"):
        _engine_cost(["eldr"], {}, tmp_path, "http://127.0.0.1:1")
    (tmp_path / "cost-model.json").write_text("{}")  # measured before: reused, nothing run
    assert _engine_cost(["eldr"], {}, tmp_path, "http://127.0.0.1:1") == (
        tmp_path / "cost-model.json")


def test_vllm_routers_kv_aware_decode_follows_each_decode_workers_own_events(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from examples.bench_kv_routers import _vllm_router_policies

    known = {"kv": {"block_size": 128, "decode": [{"endpoint": "ipc:///k/2"},
                                                  {"endpoint": "tcp://h:5700"}]}}
    # Before the warm-up prompt's blocks, then after (asked again for the relayed flags).
    states = iter([{"kv": {"block_size": None}}, known, known])
    sent = []

    class Answer:
        status_code = 200

        def __init__(self, doc: dict) -> None:
            self._doc = doc

        def json(self) -> dict:
            return self._doc

    def get(url: str, timeout: float) -> Answer:
        if url.endswith("/v1/models"):
            return Answer({"data": [{"id": "tiny"}]})
        return Answer(next(states))

    monkeypatch.setattr(httpx, "get", get)
    monkeypatch.setattr(httpx, "post",
                        lambda url, json, timeout: sent.append(json) or Answer({}))
    monkeypatch.setattr("time.sleep", lambda s: None)
    state = {"decode_workers": [{"url": "http://d0"}, {"url": "http://d1"}]}
    flags = _vllm_router_policies("cache_aware", "kv_aware", "http://proxy", state)
    relayed = _vllm_router_policies("cache_aware", "kv_aware", "http://proxy", state,
                                    lambda e: f"tcp://relay/{e[-1]}")
    assert sent and sent[0]["model"] == "tiny"
    assert flags == [
        "--policy", "kv_aware", "--prefill-policy", "cache_aware", "--decode-policy",
        "kv_aware", "--kv-event-block-size", "128", "--kv-event-model", "tiny",
        "--kv-event-source", "http://d0=ipc:///k/2",
        "--kv-event-replay-source", "http://d0=ipc:///k/2.replay",
        "--kv-event-source", "http://d1=tcp://h:5700",
        "--kv-event-replay-source", "http://d1=tcp://h:5701"]
    assert relayed[-4:] == ["--kv-event-source", "http://d0=tcp://relay/2",
                            "--kv-event-source", "http://d1=tcp://relay/0"]
    # Any other decode policy: vllm-router's own flags only, nothing asked of the proxy.
    assert _vllm_router_policies("cache_aware", None, "http://proxy", state) == [
        "--policy", "cache_aware"]
    assert _vllm_router_policies("cache_aware", "power_of_two", "http://proxy", state) == [
        "--policy", "cache_aware", "--decode-policy", "power_of_two"]


def test_the_tcp_relay_carries_a_workers_events(tmp_path: Path) -> None:
    import zmq

    from examples.bench_kv_routers import tcp_relay

    context = zmq.Context.instance()
    endpoint = f"ipc://{tmp_path}/ev"
    pub, sub = context.socket(zmq.PUB), context.socket(zmq.SUB)
    pub.bind(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(tcp_relay(endpoint))
    try:
        for _ in range(100):  # until the subscription has joined, through the relay
            pub.send_multipart((b"kv", b"\x00" * 8, b"batch"))
            if sub.poll(50):
                break
        assert sub.recv_multipart() == [b"kv", b"\x00" * 8, b"batch"]
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
