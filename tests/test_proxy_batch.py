"""Multi-prompt and n > 1 requests through the proxy, against workers that echo what they got
(tests/fakes/echo_worker.py), so a test sees which prefill and prompt every merged choice
came from, and that a body only the stdlib's JSON reads (as vLLM reads bodies) reaches
them as the client sent it."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from stages.routing.policy_config import PolicyConfig
from stages.serve.proxy import create_app
from stages.serve.proxy.config import ProxyConfig
from stages.serve.proxy.front.batch_merge import Renames, merge_streams, merge_usage
from stages.serve.proxy.front.batch_split import Part, split
from stages.serve.proxy.front.request import RequestFields, prompt_key, prompts_of
from stages.serve.proxy.legs.answer import Stream
from stages.serve.proxy.state import ProxyState
from stages.signature import wire
from tests.fakes.artifact import domain_artifact
from tests.fakes.echo_worker import CHAT, CMPL, Echo
from tests.fakes.worker import BackgroundServer

K = 3
QUIET_S = 0.2  # how long the workers must have received nothing before the next test starts


@dataclass
class Cluster:
    prefill: Echo
    decode: list[Echo]
    state: ProxyState
    client: httpx.Client

    def reset(self) -> None:
        for e in (self.prefill, *self.decode):
            e.received.clear()
            e.headers.clear()
            e.reject = e.cut = None
            e.delay_s = e.decode_delay_s = 0.0
            e.decode_status = None

    def arrivals(self) -> int:
        return sum(len(e.received) for e in (self.prefill, *self.decode))

    def decodes(self) -> list[dict[str, Any]]:
        return [b for d in self.decode for b in d.received]

    def inflight(self) -> list[int]:
        return [int(x) for x in self.state.decode.loads()]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    prefill, decode = Echo("p"), [Echo(f"d{i}") for i in range(K)]
    servers = [BackgroundServer(e.app(), "critical").start() for e in (prefill, *decode)]
    config = ProxyConfig(
        prefill_urls=(servers[0].url,), decode_urls=tuple(s.url for s in servers[1:]),
        policy="eldr", policy_config=PolicyConfig.from_mapping({"eldr": {"tau": 0.0}}),
        artifact_store=Path("/a"), model="m", max_fanout=8,
        max_body_bytes=64 * 1024,
        connect_timeout_s=1.0, prefill_timeout_s=3.0, decode_timeout_s=3.0,
        health_interval_s=0.05,
    )
    app = create_app(config, artifact_loader=lambda root, version: domain_artifact(K))
    try:
        with BackgroundServer(app) as proxy, httpx.Client(base_url=proxy.url, timeout=10) as c:
            yield Cluster(prefill, decode, app.state.proxy, c)
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def env(cluster: Cluster) -> Iterator[Cluster]:
    cluster.reset()
    yield cluster
    # Sub-requests cancelled when another failed release their workers as their tasks unwind,
    # which may be a moment after the client has its answer.
    deadline = time.monotonic() + 2
    while cluster.inflight() != [0] * K and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cluster.inflight() == [0] * K
    # A sub-request the proxy cancelled may still reach its worker after the client has its
    # answer: it must land in this test's records, not the next test's. Wait until no worker
    # has received anything for a moment.
    seen, quiet_since = cluster.arrivals(), time.monotonic()
    deadline = quiet_since + 2
    while time.monotonic() - quiet_since < QUIET_S and time.monotonic() < deadline:
        time.sleep(0.01)
        if cluster.arrivals() != seen:
            seen, quiet_since = cluster.arrivals(), time.monotonic()


def events_of(r: httpx.Response) -> list[Any]:
    assert r.headers["content-type"].startswith("text/event-stream")
    raw = [e for e in r.content.split(b"\n\n") if e]
    assert raw[-1] == b"data: [DONE]" and raw.count(b"data: [DONE]") == 1
    return [orjson.loads(e[6:]) for e in raw[:-1]]


def texts_by_index(events: list[Any], chat: bool = False) -> dict[int, str]:
    out: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            piece = choice["delta"].get("content", "") if chat else choice["text"]
            out[choice["index"]] = out.get(choice["index"], "") + piece
    return out


# --- whole answers --------------------------------------------------------------------------


def test_each_prompt_gets_its_own_prefill_and_decode(env: Cluster) -> None:
    prompts = ["domain=0 a", "domain=2 b", "domain=1 c"]
    r = env.client.post(CMPL, json={"prompt": prompts, "max_tokens": 2},
                        headers={"X-Request-Id": "req-1"})
    assert r.status_code == 200, r.text
    data = r.json()
    assert r.headers["x-request-id"] == "req-1"
    assert data["id"] == "cmpl-req-1"  # the client's id, not a sub-request's
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    texts = [c["text"].split("|") for c in data["choices"]]
    assert [t[0] for t in texts] == prompts
    # Routed per prompt by its own signature; every decode got a hand-off of its own.
    assert [t[3] for t in texts] == ["d0", "d2", "d1"]
    assert len({t[2] for t in texts}) == 3
    assert all("[" in t[2] for t in texts)
    prefills = env.prefill.received
    # Each as a list of one: a batch element, as vLLM reads it ("" included).
    assert sorted(p["prompt"] for p in prefills) == [[p] for p in sorted(prompts)]
    assert all(p["n"] == 1 and p["max_tokens"] == 1 for p in prefills)
    sub_ids = sorted(h["x-request-id"] for h in env.prefill.headers)
    own = sub_ids[0].removesuffix("-0")  # eldr's own id: the client's is no key upstream
    assert own != "req-1" and sub_ids == [f"{own}-0", f"{own}-1", f"{own}-2"]
    assert all(wire.SIGNATURE_KEY not in d["kv_transfer_params"] for d in env.decodes())
    # Usage summed; per-request metrics dropped, as vLLM drops them for several sequences.
    assert data["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 6,
                             "total_tokens": sum(map(len, prompts)) + 6}
    assert data["metrics"] is None


def test_token_id_prompts_are_split_and_one_token_list_is_not(env: Cluster) -> None:
    r = env.client.post(CMPL, json={"prompt": [[1, 2], [3]], "max_tokens": 2})
    assert [c["text"].split("|")[0] for c in r.json()["choices"]] == ["[1, 2]", "[3]"]
    env.reset()
    for one in ([1, 2], ["1", 2], ["only"], [[5, 6]]):
        r = env.client.post(CMPL, json={"prompt": one, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 1
    assert [p["prompt"] for p in env.prefill.received] == [[1, 2], ["1", 2], ["only"], [[5, 6]]]


def test_n_choices_each_get_a_hand_off_and_vllms_seeds(env: Cluster) -> None:
    r = env.client.post(CMPL, json={"prompt": ["domain=1 a", "domain=2 b"], "n": 2,
                                    "seed": 7, "max_tokens": 2})
    assert r.status_code == 200, r.text
    data = r.json()
    parts = [c["text"].split("|") for c in data["choices"]]
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert [p[0] for p in parts] == ["domain=1 a"] * 2 + ["domain=2 b"] * 2
    assert [p[1] for p in parts] == ["seed=7", "seed=8", "seed=7", "seed=8"]
    assert len({p[2] for p in parts}) == 4  # four prefills, four hand-offs
    assert all(d["n"] == 1 for d in env.decodes())
    # A prompt's tokens count once, however many choices it has.
    assert data["usage"]["prompt_tokens"] == len("domain=1 a") + len("domain=2 b")
    assert data["usage"]["completion_tokens"] == 8


def test_later_choices_prefill_after_the_first(env: Cluster) -> None:
    env.prefill.delay_s = 0.2
    r = env.client.post(CMPL, json={"prompt": "domain=0", "n": 3, "max_tokens": 2})
    assert r.status_code == 200
    # The first choice's prefill ran alone; the two others followed it (prefix-cache hits).
    ids = [h["x-request-id"] for h in env.prefill.headers]
    assert ids[0].endswith("-0") and sorted(ids[1:]) == [ids[0][:-1] + "1", ids[0][:-1] + "2"]


def test_chat_n_is_split_and_without_seed_none_is_made_up(env: Cluster) -> None:
    body = {"messages": [{"role": "user", "content": "domain=2 hi"}], "n": 2, "max_tokens": 2}
    r = env.client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["content"].startswith("domain=2 hi|seed=None") for c in choices)


def test_beam_search_is_one_request_per_prompt(env: Cluster) -> None:
    r = env.client.post(CMPL, json={"prompt": ["a", "b"], "n": 3, "use_beam_search": "true"})
    assert r.status_code == 200, r.text
    assert [d["n"] for d in env.decodes()] == [3, 3]
    # Each answer's choice 0 lands at its prompt's first index.
    assert [c["index"] for c in r.json()["choices"]] == [0, 3]


def test_one_refused_prompt_refuses_the_request(env: Cluster) -> None:
    env.prefill.reject = "bad"
    r = env.client.post(CMPL, json={"prompt": ["fine", "bad one", "fine too"]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "too long"


def test_fan_out_limit_and_n_checks(env: Cluster) -> None:
    cases = [({"prompt": "x", "n": 9}, "n"), ({"prompt": ["a"] * 5, "n": 2}, "prompt"),
             ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "n": "two"}, "n"),
             ({"prompt": "x", "n": None}, "n"), ({"prompt": "x", "n": 16385}, "n"),
             ({"prompt": "x", "use_beam_search": None}, "use_beam_search"),
             ({"prompt": "x", "use_beam_search": "maybe"}, "use_beam_search"),
             ({"prompt": ["a", "b"], "prompt_embeds": "AAAA"}, "prompt_embeds")]
    for body, param in cases:
        r = env.client.post(CMPL, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert not env.prefill.received  # refused before any prefill
    chat = {"messages": [{"role": "user", "content": "x"}], "n": None}
    assert env.client.post(CHAT, json=chat).status_code == 200  # chat's n may be null


@pytest.mark.parametrize("stream", [False, True])
def test_a_sub_request_whose_worker_fails_is_retried_alone(env: Cluster, stream: bool) -> None:
    env.decode[0].decode_status = 500
    prompts = ["domain=0 a", "domain=1 b", "domain=2 c"]
    r = env.client.post(CMPL, json={"prompt": prompts, "stream": stream})
    assert r.status_code == 200, r.text
    texts = (texts_by_index(events_of(r)) if stream
             else {c["index"]: c["text"] for c in r.json()["choices"]})
    assert [texts[i].split("|")[0] for i in range(3)] == prompts
    # The failed one went elsewhere with a fresh hand-off (a prefill of its own again).
    assert texts[0].split("|")[3] != "d0"
    assert len(env.prefill.received) == 4
    for i in range(K):  # the health loop would re-admit d0 only after its next probe
        env.state.decode.mark_healthy(i)


def test_a_split_may_not_multiply_a_body_into_megabytes(env: Cluster) -> None:
    # 40 KB of fields repeated by 8 sub-requests: over 4 x the 64 KiB body limit.
    body = {"prompt": [f"p{i}" for i in range(8)], "logit_bias": {str(i): 0 for i in range(4000)}}
    r = env.client.post(CMPL, json=body)
    assert r.status_code == 413 and r.json()["error"]["type"] == "too_large"
    assert not env.prefill.received
    body["logit_bias"] = {"1": 0}
    assert env.client.post(CMPL, json=body).status_code == 200


# --- streams --------------------------------------------------------------------------------


def test_streams_merge_into_one_with_vllms_indices(env: Cluster) -> None:
    prompts = ["domain=0 a", "domain=1 b"]
    body = {"prompt": prompts, "n": 2, "stream": True, "max_tokens": 2,
            "stream_options": {"include_usage": True}}
    r = env.client.post(CMPL, json=body, headers={"X-Request-Id": "s-1"})
    assert r.status_code == 200
    events = events_of(r)
    assert {e["id"] for e in events} == {"cmpl-s-1"}
    texts = texts_by_index(events)
    assert sorted(texts) == [0, 1, 2, 3]
    assert [texts[i].split("|")[0] for i in range(4)] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert all(t.endswith("!") for t in texts.values())
    usage = [e for e in events if e["choices"] == []]
    assert len(usage) == 1 and events[-1] is usage[0]  # one usage chunk, last
    assert usage[0]["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert usage[0]["usage"]["completion_tokens"] == 8


def test_chat_stream_with_n(env: Cluster) -> None:
    body = {"messages": [{"role": "user", "content": "domain=1 q"}], "n": 3, "stream": True}
    events = events_of(env.client.post(CHAT, json=body))
    texts = texts_by_index(events, chat=True)
    assert sorted(texts) == [0, 1, 2]
    assert not [e for e in events if e["choices"] == []]  # no usage asked, none sent


def test_a_sub_stream_breaking_ends_the_merged_stream_with_one_error(env: Cluster) -> None:
    for d in env.decode:
        d.cut = "bad"
    r = env.client.post(CMPL, json={"prompt": ["domain=0 ok", "domain=1 bad"], "stream": True})
    assert r.status_code == 200
    raw = [e for e in r.content.split(b"\n\n") if e]
    assert raw[-1] == b"data: [DONE]" and raw.count(b"data: [DONE]") == 1
    errors = [orjson.loads(e[6:]) for e in raw[:-1] if e.startswith(b'data: {"error"')]
    assert len(errors) == 1 and raw[-2].startswith(b'data: {"error"')


def test_client_leaving_a_merged_stream_frees_every_worker(env: Cluster) -> None:
    body = {"prompt": ["domain=0 a", "domain=1 b", "domain=2 c"], "stream": True}
    with env.client.stream("POST", CMPL, json=body) as r:
        chunks = r.iter_raw()
        assert next(chunks).startswith(b"data: ")
    deadline = time.monotonic() + 3
    while env.inflight() != [0] * K and time.monotonic() < deadline:
        time.sleep(0.01)
    assert env.inflight() == [0] * K


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_before_the_merged_answer_frees_every_worker(
    env: Cluster, stream: bool
) -> None:
    for d in env.decode:
        d.decode_delay_s = 2.0
    body = {"prompt": ["domain=0 a", "domain=1 b", "domain=2 c"], "stream": stream}
    with pytest.raises(httpx.ReadTimeout):
        env.client.post(CMPL, json=body, timeout=0.5)
    deadline = time.monotonic() + 1.0  # well before the slow decode would have answered
    while env.inflight() != [0] * K and time.monotonic() < deadline:
        time.sleep(0.01)
    assert env.inflight() == [0] * K


# --- the parts without HTTP -----------------------------------------------------------------

FIELDS = RequestFields(stream=False, n=1, beam_search=False)


def test_prompts_of_reads_like_vllms_union() -> None:
    assert prompts_of({"prompt": ["a", "b"]}) == ["a", "b"]
    assert prompts_of({"prompt": ["1", "2"]}) == ["1", "2"]  # exact list[str]
    assert prompts_of({"prompt": [[1], ["2"]]}) == [[1], ["2"]]
    for one in ("a", ["a"], [1, 2], ["1", 2], [], [[1]], None):
        assert prompts_of({"prompt": one}) is None


def test_split_indices_and_seeds() -> None:
    fields = RequestFields(stream=False, n=2, beam_search=False)
    parts = split({"prompt": ["a", "b"], "seed": "3", "n": 2}, False, fields, 16, 10**6)
    assert parts is not None
    assert [(p.body["prompt"], p.body["seed"], p.first_index, p.counts_prompt)
            for p in parts] == [(["a"], 3, 0, True), (["a"], 4, 1, False),
                                (["b"], 3, 2, True), (["b"], 4, 3, False)]
    assert split({"prompt": "a"}, False, FIELDS, 16, 10**6) is None
    assert split({"messages": []}, True, FIELDS, 16, 10**6) is None


def test_usage_merge() -> None:
    usages = [({"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"c": 1},
                "completion_tokens_details": {"reasoning_tokens": 1}}, True),
              ({"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"c": 9},
                "completion_tokens_details": {"reasoning_tokens": 2}}, False),
              (None, True)]
    assert merge_usage(usages) == {
        "prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
        "prompt_tokens_details": {"c": 1}, "completion_tokens_details": {"reasoning_tokens": 3}}
    assert merge_usage([(None, True)]) is None


@pytest.mark.anyio
async def test_merge_streams_keeps_comments_and_drops_sub_dones() -> None:
    async def stream(blocks: list[bytes]) -> AsyncIterator[bytes]:
        for b in blocks:
            yield b

    async def nothing() -> None:
        return None

    a = [b": keep-alive\n\n", b'data: {"id":"cmpl-r-0","choices":[{"index":0,"text":"x"}]}\n\n'
         b"data: [DONE]\n\n"]
    b = [b'data: {"id":"cmpl-r-1","choices":[{"index":0,"text":"y"}]}\n\ndata: [DONE]\n\n']
    parts = [Part({}, 0, 0, True), Part({}, 1, 1, True)]
    streams = [Stream(stream(a), nothing, "text/event-stream"),
               Stream(stream(b), nothing, "text/event-stream")]
    out = b"".join([x async for x in merge_streams(parts, streams, Renames(["r-0", "r-1"], "r"))])
    assert out.count(b"[DONE]") == 1 and out.endswith(b"data: [DONE]\n\n")
    assert b": keep-alive\n\n" in out
    assert b'{"id":"cmpl-r","choices":[{"index":1,"text":"y"}]}' in out


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- bodies only the stdlib's JSON reads (as vLLM reads them) go through unchanged ----------

# Not here: integers past 64 bits, which orjson reads as floats. Every integer field of vLLM's
# request models is bounded to 64 bits, so vLLM refuses them either way (a 400 both ways).
LAX_BODIES = {
    "utf8-bom": b"\xef\xbb\xbf" + b'{"prompt": "domain=1", "max_tokens": 2}',
    "utf16": '{"prompt": "domain=1", "max_tokens": 2}'.encode("utf-16"),
    "utf32-no-bom": '{"prompt": "domain=1", "max_tokens": 2}'.encode("utf-32-le"),
    "nan": b'{"prompt": "domain=1", "temperature": NaN}',
    "infinity": b'{"prompt": "domain=1", "top_p": -Infinity}',
    "lone-surrogate": b'{"prompt": "domain=1", "user": "\\ud800"}',
}


@pytest.mark.parametrize("raw", LAX_BODIES.values(), ids=LAX_BODIES.keys())
def test_what_only_the_stdlib_reads_reaches_the_workers_unchanged(env: Cluster,
                                                                   raw: bytes) -> None:
    r = env.client.post(CMPL, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    sent = json.loads(raw)
    for got in (*env.prefill.received, *env.decodes()):
        for key in sent.keys() - {"max_tokens"}:
            assert json.dumps(got[key]) == json.dumps(sent[key]), key  # NaN == NaN as text


def test_split_of_a_lax_body_keeps_it_lax(env: Cluster) -> None:
    raw = b'{"prompt": ["domain=0", "domain=1"], "temperature": NaN}'
    r = env.client.post(CMPL, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert [math.isnan(d["temperature"]) for d in env.decodes()] == [True, True]


def test_a_split_prompt_keeps_its_prefill_affinity() -> None:
    assert prompt_key({"prompt": ["abc"]}, False) == prompt_key({"prompt": "abc"}, False)


def test_prompt_key_of_what_orjson_cannot_write() -> None:
    assert prompt_key({"prompt": "\ud800"}, False) == "\ud800".encode(errors="surrogatepass")
    assert prompt_key({"prompt": [[2**70]]}, False) == b"[[1180591620717411303424]]"
