"""Decode chosen at arrival: once the prefill's signature is there, the policy counts the
request's batch with it instead of the estimate it was chosen on (``on_signature``)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import numpy as np
import pytest

from stages.bench.sim.conversation_sim import ConversationSimConfig, simulate_outcomes
from stages.bench.sim.conversation_workload import SimConversationSpec
from stages.bench.sim.synthetic import SyntheticSpec, synthetic_signatures
from stages.errors import EldrError
from stages.routing import policies as routing_policies
from stages.routing.context import RoutingContext
from stages.routing.cost_model import gpu_like
from stages.routing.policies import DecodePolicy, RoutingRequest, make_policy
from stages.serve.proxy.router.decode_router import DecodeRouter, Features
from tests.fakes.worker import SIGNATURE_SHAPE
from tests.test_decode_at_arrival import PROMPT, _arrival_with_block_size_known, _record_choices
from tests.test_kv_view import kv_proxy as kv_proxy  # a fixture, used by name

LAYERS, EXPERTS, TOP_K, WORKERS = 4, 16, 2, 3


def _request(counts: np.ndarray | None) -> RoutingRequest:
    return RoutingRequest(np.zeros(WORKERS, np.int64), np.ones(WORKERS, bool), None, counts)


def _policy():  # type: ignore[no-untyped-def]
    context = RoutingContext(WORKERS, top_k=TOP_K, cost=gpu_like(LAYERS, EXPERTS))
    return make_policy("eldr-kv", context, {"decode_choice": "arrival", "sample_layers": 0})


def _counts(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.multinomial(40 * TOP_K, rng.dirichlet(np.full(EXPERTS, 0.3)),
                           size=LAYERS).astype(np.int32)


def test_the_prefill_signature_replaces_the_estimate_in_its_workers_batch() -> None:
    exact, other = _counts(0), _counts(1)
    flat = np.full((LAYERS, EXPERTS), 40 * TOP_K // EXPERTS, np.int32)  # a mean-like guess
    told = _policy()
    told.on_dispatch(0, _request(other), "running")
    told.on_dispatch(0, _request(flat), "new")
    told.on_signature(0, _request(exact), "new")
    known = _policy()
    known.on_dispatch(0, _request(other), "running")
    known.on_dispatch(0, _request(exact), "new")
    np.testing.assert_allclose(told._load.distinct, known._load.distinct, rtol=1e-6)
    # Its completion takes out what it counts with now, leaving the other request's experts.
    told.on_complete(0, "new")
    known.on_complete(0, "new")
    np.testing.assert_allclose(told._load.distinct, known._load.distinct, rtol=1e-6)


def test_a_request_chosen_without_an_estimate_counts_with_the_prefills_after() -> None:
    exact = _counts(3)
    told = _policy()
    told.on_dispatch(1, _request(_counts(2)), "running")
    told.on_dispatch(1, _request(None), "new")  # nothing known at arrival
    told.on_signature(1, _request(exact), "new")
    told.on_signature(1, _request(None), "new")  # no usable signature: kept as it was
    known = _policy()
    known.on_dispatch(1, _request(_counts(2)), "running")
    known.on_dispatch(1, _request(exact), "new")
    np.testing.assert_allclose(told._load.distinct, known._load.distinct, rtol=1e-6)


def test_a_signature_for_another_worker_than_the_dispatch_is_refused() -> None:
    policy = _policy()
    policy.on_dispatch(0, _request(_counts(4)), "new")
    with pytest.raises(EldrError, match="sent to 0"):
        policy.on_signature(2, _request(_counts(5)), "new")


class _Signed(DecodePolicy):
    """Records each ``on_signature`` call's key and whether it came before the decode ran."""

    name: ClassVar[str] = "signed"
    uses_counts: ClassVar[bool] = True
    signed: ClassVar[list[tuple[Hashable, np.ndarray | None]]] = []

    @property
    def decodes_at_arrival(self) -> bool:
        return True

    def choose(self, request: RoutingRequest) -> int:
        return int(np.argmin(request.loads))

    def on_signature(self, worker: int, request: RoutingRequest, key: Hashable) -> None:
        self.signed.append((key, request.counts))


def test_the_simulator_tells_a_policy_that_chose_at_arrival_each_prefills_signature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    arrays = synthetic_signatures(SyntheticSpec(num_requests=50, num_layers=LAYERS,
                                                num_experts=EXPERTS, top_k=TOP_K,
                                                domain_experts=6))
    monkeypatch.setitem(routing_policies.POLICIES, _Signed.name, _Signed)
    monkeypatch.setattr(_Signed, "signed", [])
    spec = SimConversationSpec(conversations=10, turns=2, conversation_rate=10.0,
                               system_tokens=64, message_tokens=32, output_tokens=16)
    config = ConversationSimConfig(cost=gpu_like(LAYERS, EXPERTS), workload=spec,
                                   num_prefill=2, num_decode=WORKERS, policies=(_Signed.name,))
    turns, _, _ = simulate_outcomes(config, arrays, TOP_K)
    assert sorted(key for key, _ in _Signed.signed) == list(range(len(turns)))
    for key, counts in _Signed.signed:
        np.testing.assert_array_equal(counts, arrays.prefill_counts[int(turns.row[key])])


def test_the_proxys_arrival_decision_takes_the_prefills_signature() -> None:
    exact, other = _counts(6), _counts(7)
    flat = np.full((LAYERS, EXPERTS), 40 * TOP_K // EXPERTS, np.int32)
    loads, eligible = np.zeros(WORKERS, np.int64), np.ones(WORKERS, bool)
    told = DecodeRouter(WORKERS, "eldr-kv", None, model_top_k=TOP_K)
    told.choose(Features(None, False, other), loads, eligible)
    decision = told.choose(Features(None, False, flat), loads, eligible)
    assert decision.on_signature is not None
    decision.on_signature(Features(None, True))  # no signature from the prefill: kept
    decision.on_signature(Features(None, False, exact))
    known = DecodeRouter(WORKERS, "eldr-kv", None, model_top_k=TOP_K)
    known.policy.on_dispatch(told.policy._members[0][0], _request(other), "running")
    known.policy.on_dispatch(decision.worker, _request(exact), "new")
    np.testing.assert_allclose(told.policy._load.distinct, known.policy._load.distinct,
                               rtol=1e-6)


def test_the_proxy_hands_the_prefills_signature_to_the_policy_that_chose_at_arrival(
    kv_proxy, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    state, behaviors, client = kv_proxy
    _arrival_with_block_size_known(state, client)
    calls = _record_choices(state, behaviors)
    policy = state.router.policy
    signed: list[tuple[int, np.ndarray | None]] = []
    monkeypatch.setattr(policy, "on_signature",
                        lambda worker, request, key: signed.append((worker, request.counts)))
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
    assert r.is_success
    assert len(calls) == 1 and len(signed) == 1
    worker, counts = signed[0]
    assert worker == calls[0].worker
    assert counts is not None and counts.shape == SIGNATURE_SHAPE
