"""decode_choice "arrival" in the proxy: the decode worker is chosen before the prefill runs, on
the prompt's signature at arrival (its cached blocks' expert counts), and a request whose
prefill fails leaves nothing behind in the policy."""

from __future__ import annotations

import threading
from dataclasses import fields, replace
from typing import Any, NamedTuple

import numpy as np
from typing_extensions import get_protocol_members

from stages.routing.kv.block_experts import BlockExperts, ExpertEventsView
from stages.routing.kv.block_hashes import BlockHasher
from stages.serve.proxy.router.decode_router import NO_KV, DecodeRouter
from stages.signature.token_predictor import TokenPredictor
from tests.fakes.artifact import FAKE_MODEL, domain_artifact
from tests.fakes.worker import SIGNATURE_SHAPE
from tests.test_kv_view import batch, stored
from tests.test_kv_view import kv_proxy as kv_proxy  # a fixture, used by name
from tests.test_proxy import wait_until

PROMPT = "The committee reviewed the annual report on water quality. " * 30


def _arrival(client: Any) -> None:
    assert client.post("/admin/policy", json={
        "policy": "eldr-kv", "config": {"decode_choice": "arrival"}}).is_success


class Choice(NamedTuple):
    prefills_before: int  # prefill requests the workers had received when it was made
    features: Any
    done: list[int]  # the completions its decision heard
    worker: int


def _arrival_with_block_size_known(state: Any, client: Any) -> None:
    """Arrival choice on, and the block size told by a prefill worker holding the first block."""
    _arrival(client)
    ids = state.kv.tokenizer.completion({"prompt": PROMPT})
    state.kv.prefill.apply(0, 0, batch(stored(BlockHasher().hashes(ids, 32)[:1],
                                              block_size=32)))


def _record_choices(state: Any, behaviors: list) -> list[Choice]:
    """Each choice the router makes."""
    calls: list[Choice] = []
    choose = state.router.choose

    def recording(features, loads, eligible, kv=NO_KV):  # type: ignore[no-untyped-def]
        decision = choose(features, loads, eligible, kv)
        done: list[int] = []
        calls.append(Choice(sum(len(b.received) for b in behaviors[:2]), features, done,
                            decision.worker))

        def on_complete(worker: int) -> None:
            done.append(worker)
            decision.on_complete(worker)

        return decision._replace(on_complete=on_complete)

    state.router.choose = recording
    return calls


def _count_decode_matches(state: Any) -> list[int]:
    """The blocks of each match of a prompt against the decode workers' caches, from now on."""
    matches: list[int] = []
    match = state.kv.decode.cached_tokens

    def counting(blocks):  # type: ignore[no-untyped-def]
        matches.append(len(blocks))
        return match(blocks)

    state.kv.decode.cached_tokens = counting
    return matches


def test_the_decode_worker_is_chosen_before_the_prefill_on_the_cached_prefix(kv_proxy) -> None:
    state, behaviors, client = kv_proxy
    _arrival(client)
    ids = state.kv.tokenizer.completion({"prompt": PROMPT})
    hashes = BlockHasher().hashes(ids, 32)
    state.kv.prefill.apply(0, 0, batch(stored(hashes, block_size=32)))  # the block size
    # Every cached block routed all its tokens to expert 3 of every layer.
    block = np.zeros(SIGNATURE_SHAPE, dtype=np.int32)
    block[:, 3] = 32
    index = BlockExperts()
    for h in hashes:
        index.stored(h, block)
    state.block_experts = ExpertEventsView(2, index)
    calls = _record_choices(state, behaviors)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert len(calls) == 1  # one choice, not a second one after the prefill
    prefills_before, features, done, _ = calls[0]
    assert prefills_before == 0
    # No predictor: the cached prefix's routing per token, carried over the whole prompt.
    assert features.counts is not None and not features.missing
    assert int(np.argmax(features.counts.sum(axis=0))) == 3
    assert sum(len(b.received) for b in behaviors[:2]) == 1  # the prefill still ran remotely
    wait_until(lambda: len(done) == 1)


def test_a_prefill_that_fails_releases_the_decode_chosen_at_arrival(kv_proxy) -> None:
    state, behaviors, client = kv_proxy
    _arrival_with_block_size_known(state, client)
    for b in behaviors[:2]:
        b.fail_status = 400  # a client error: not retried elsewhere
    calls = _record_choices(state, behaviors)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 400
    assert len(calls) == 1 and len(calls[0].done) == 1  # the policy heard it end
    assert state.decode.loads().sum() == 0


def test_a_decode_worker_that_leaves_during_the_prefill_is_chosen_again(kv_proxy) -> None:
    state, behaviors, client = kv_proxy
    _arrival_with_block_size_known(state, client)
    calls = _record_choices(state, behaviors)
    for b in behaviors[:2]:
        b.delay_s = 0.5  # the prefill takes a while
    answers: list[Any] = []
    sender = threading.Thread(target=lambda: answers.append(client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})))
    sender.start()
    wait_until(lambda: len(calls) == 1)
    left = calls[0].worker
    behaviors[2 + left].healthy = False  # its health probes fail from now on
    state.decode.mark_unhealthy(left, "gone while the prefill ran")
    sender.join(10)
    assert answers and answers[0].status_code == 200, answers
    assert [c.worker for c in calls] == [left, 1 - left]  # chosen again, elsewhere
    assert calls[0].done == [left]  # the first choice was dropped from the policy
    assert len(behaviors[2 + left].received) == 0 and len(behaviors[3 - left].received) == 1


def test_the_decode_workers_caches_are_matched_once_and_counted_as_the_choice_saw_them(
        kv_proxy) -> None:
    state, _, client = kv_proxy
    _arrival_with_block_size_known(state, client)
    body = {"prompt": PROMPT, "max_tokens": 8}
    ids = state.kv.tokenizer.completion(body)
    state.kv.decode.apply(0, 0, batch(stored(BlockHasher().hashes(ids, 32), block_size=32)))
    prompt = state.kv.prompt(body, False, all_ids=True)
    held = state.kv.decode.cached_tokens(prompt.reusable)
    assert held[0] > 0 and held[1] == 0
    matches = _count_decode_matches(state)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(matches) == 1  # at arrival; the decode leg reuses it
    sample = state.metrics.registry.get_sample_value
    assert sample("eldr_kv_prompt_tokens_total", {"leg": "decode"}) == prompt.tokens
    assert sample("eldr_kv_cached_tokens_total", {"leg": "decode"}) == held[0]


def test_with_local_prefill_on_the_decode_workers_caches_are_matched_once(kv_proxy) -> None:
    state, behaviors, client = kv_proxy
    _arrival_with_block_size_known(state, client)
    # Local prefill on too, below one token: no decode worker holds the prompt, so the local
    # choice declines it after matching the prompt, and the arrival choice follows.
    assert client.post("/admin/policy", json={"policy": "eldr-kv", "config": {
        "decode_choice": "arrival", "local_prefill_below": 1}}).is_success
    assert state.router.policy.prefills_locally and state.router.policy.decodes_at_arrival
    matches = _count_decode_matches(state)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert sum(len(b.received) for b in behaviors[:2]) == 1  # the PD path took it
    assert len(matches) == 1  # for the local choice; the arrival choice reuses it


def _decisions_timed(state: Any) -> float:
    count = state.metrics.registry.get_sample_value("eldr_router_decision_seconds_count")
    return count or 0.0


def test_a_decision_made_at_arrival_is_timed_once(kv_proxy) -> None:
    state, _, client = kv_proxy
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert _decisions_timed(state) == 1  # chosen after the prefill
    _arrival_with_block_size_known(state, client)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert _decisions_timed(state) == 2  # chosen at arrival, not timed again by the decode leg


def test_a_retry_that_chooses_again_is_timed_as_a_decision_of_its_own(kv_proxy) -> None:
    state, behaviors, client = kv_proxy
    _arrival_with_block_size_known(state, client)
    calls = _record_choices(state, behaviors)
    for b in behaviors[2:]:
        b.fail_status = 503  # every decode worker fails before streaming: each is tried once
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 502, r.text
    assert len(calls) == 2  # at arrival, then the retry on the other worker
    assert _decisions_timed(state) == 2


def test_the_artifact_shape_the_router_reads_declares_the_token_predictor() -> None:
    from stages.fit.artifact import Artifact
    from stages.serve.proxy.router.artifact_source import ArtifactLike

    declared = get_protocol_members(ArtifactLike)
    assert "token_predictor" in declared
    assert declared <= {f.name for f in fields(Artifact)}  # the fit stage's artifact has them


def test_an_artifacts_token_predictor_gives_the_signature_at_arrival_without_events() -> None:
    layers, experts = FAKE_MODEL.shape
    mean = np.zeros((layers, experts), np.float32)
    mean[:, 5] = 2.0  # every token routes to expert 5 of every layer
    predictor = TokenPredictor(np.zeros(0, np.int32), np.zeros((0, 1), np.float32),
                               np.zeros((1, layers * experts), np.float32), mean.ravel(),
                               (layers, experts))
    router = DecodeRouter(2, "eldr-kv", replace(domain_artifact(2), token_predictor=predictor),
                          model_top_k=FAKE_MODEL.top_k)
    features = router.arrival_features(list(range(64)), [], 32, None)
    assert not features.missing and features.counts is not None
    assert int(np.argmax(features.counts.sum(axis=0))) == 5
