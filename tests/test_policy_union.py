"""The batch-aware policy (eldr-union): per-request bookkeeping, its rule, and its fallbacks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from stages.errors import EldrError
from stages.routing.context import RoutingContext
from stages.routing.cost_model import CostModel
from stages.routing.inputs import routing_inputs
from stages.routing.policies import (
    EldrUnionPolicy,
    RoutingRequest,
    UnionParams,
    make_policy,
    needs_centroids,
)
from stages.routing.policies.eldr_union import sampled_layers
from stages.routing.policies.expert_load import WorkerExpertLoad
from stages.routing.policies.union_kernels import sampled_inclusion
from stages.serve.proxy.router.decode_router import DecodeRouter
from stages.signature import wire
from stages.signature.inclusion import inclusion_probabilities
from tests.fakes.artifact import domain_artifact

LAYERS, EXPERTS, TOP_K = 2, 8, 2
# Expert cost dominates the per-sequence cost, as in memory-bound MoE decode.
COST = CostModel(num_layers=LAYERS, base_s=1e-3, per_token_s=2e-4, per_expert_s=1e-3)


def peaked(experts: tuple[int, ...], tokens: int = 20) -> np.ndarray:
    """Counts of a prompt whose tokens each pick ``TOP_K`` of ``experts`` in every layer."""
    counts = np.zeros((LAYERS, EXPERTS), np.int32)
    counts[:, list(experts)] = tokens * TOP_K // len(experts)
    return counts


A, B = peaked((0, 1)), peaked((4, 5))


def policy(
    workers: int = 2, worker_slots: int | None = None, load_slack: float | None = None
) -> EldrUnionPolicy:
    context = RoutingContext(workers, top_k=TOP_K, cost=COST, worker_slots=worker_slots)
    params = UnionParams() if load_slack is None else UnionParams(load_slack=load_slack)
    return EldrUnionPolicy(context, params)


def req(loads, counts=None, eligible=None) -> RoutingRequest:
    loads = np.asarray(loads, np.int64)
    elig = np.ones(loads.size, bool) if eligible is None else np.asarray(eligible, bool)
    return RoutingRequest(loads=loads, eligible=elig, counts=counts)


def dispatch(p: EldrUnionPolicy, worker: int, counts: np.ndarray, key: object, loads) -> None:
    p.on_dispatch(worker, req(loads, counts), key)


def added(p: EldrUnionPolicy, counts: np.ndarray, loads) -> np.ndarray:
    r = req(loads, counts)
    p.choose(r)  # a decision first: it reads the signature's shape
    pi = p._predict(r)
    assert pi is not None
    # Every worker scored: a load slack no load comes near (the policies here have no slots).
    assert p.worker_slots is None
    p._score(RoutingRequest(np.asarray(loads, np.int64), np.ones(len(loads), bool)), pi,
             load_slack=1e9)
    return p._latency.copy()


def test_registry_builds_it_without_centroids() -> None:
    p = make_policy("eldr-union", RoutingContext(3, top_k=2, cost=COST, worker_slots=4))
    assert isinstance(p, EldrUnionPolicy)
    assert p.params == UnionParams()
    assert (p.top_k, p.cost, p.worker_slots) == (2, COST, 4)
    assert not needs_centroids("eldr-union")
    with pytest.raises(EldrError, match="top_k"):
        RoutingContext(3, top_k=0)
    with pytest.raises(EldrError, match="slots"):
        RoutingContext(3, worker_slots=0)


def test_dispatch_and_completion_add_and_remove_one_request_by_key() -> None:
    p = policy()
    empty = added(p, A, [0, 0])
    assert empty[0] == empty[1]
    dispatch(p, 0, A, "a", [0, 0])
    dispatch(p, 0, B, "b", [1, 0])
    both = added(p, A, [2, 0])
    p.on_complete(0, "a")
    only_b = policy()
    added(only_b, A, [0, 0])
    dispatch(only_b, 0, B, "b", [0, 0])
    # Exactly b's part is left on worker 0 (to float32 rounding): as if a had never been there.
    np.testing.assert_allclose(added(p, A, [1, 0]), added(only_b, A, [1, 0]), rtol=1e-6)
    assert not np.allclose(added(p, A, [2, 0]), both)
    p.on_complete(0, "b")
    np.testing.assert_array_equal(added(p, A, [0, 0]), empty)  # back to empty, bit for bit


def test_unknown_keys_are_ignored_and_misuse_is_an_error() -> None:
    p = policy()
    before = added(p, A, [0, 0])
    p.on_complete(1, "never-dispatched")  # e.g. sent before a policy switch
    np.testing.assert_array_equal(added(p, A, [0, 0]), before)
    dispatch(p, 1, A, 7, [0, 0])
    with pytest.raises(EldrError, match="twice"):
        dispatch(p, 0, B, 7, [0, 1])
    with pytest.raises(EldrError, match="sent to 1"):
        p.on_complete(0, 7)


def test_prefers_the_worker_whose_experts_overlap() -> None:
    p = policy()
    dispatch(p, 0, A, "a", [0, 0])
    dispatch(p, 1, B, "b", [1, 0])
    loads = [1, 1]
    assert all(p.choose(req(loads, peaked((0, 1)))) == 0 for _ in range(20))
    assert all(p.choose(req(loads, peaked((4, 5)))) == 1 for _ in range(20))
    # Overlap is worth some load: one more request is cheaper than new experts ...
    dispatch(p, 0, A, "a2", [1, 1])
    assert p.choose(req([2, 1], A)) == 0
    # ... but not any load.
    for i in range(28):
        dispatch(p, 0, A, f"more{i}", [2 + i, 1])
    assert p.choose(req([30, 1], A)) == 1


def test_load_bound_caps_what_overlap_may_buy() -> None:
    p = policy(workers=3, load_slack=0.25)
    for i in range(8):
        dispatch(p, 0, A, f"a{i}", [i, 0, 0])
    dispatch(p, 1, B, "b", [8, 0, 0])
    dispatch(p, 2, B, "b2", [8, 1, 0])
    # Mean 10/3: at most max(1, floor(0.25 * mean)) = 1 more than the least loaded.
    assert p.choose(req([8, 1, 1], A)) in (1, 2)
    # With the bound off, the overlap wins.
    free = policy(workers=3, load_slack=100.0)
    for i in range(8):
        dispatch(free, 0, A, f"a{i}", [i, 0, 0])
    dispatch(free, 1, B, "b", [8, 0, 0])
    dispatch(free, 2, B, "b2", [8, 1, 0])
    assert free.choose(req([8, 1, 1], A)) == 0
    with pytest.raises(EldrError, match="load_slack"):
        UnionParams(load_slack=-1.0)


def fast_inclusion(counts: np.ndarray, top_k: int) -> np.ndarray:
    """The policy's compiled prediction, over every layer."""
    rows = np.arange(counts.shape[0], dtype=np.int64)
    return sampled_inclusion(np.ascontiguousarray(counts), rows, top_k)


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
def test_prediction_is_the_shared_inclusion_form(dtype: type) -> None:
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 30, size=(LAYERS, EXPERTS)).astype(dtype)
    counts[1] = 0  # a layer without counts: uniform k/E
    expected = inclusion_probabilities(counts, TOP_K).ravel()
    np.testing.assert_allclose(fast_inclusion(counts, TOP_K), expected, rtol=1e-6)
    counts[1, 0] = 5
    np.testing.assert_allclose(
        fast_inclusion(counts, TOP_K), inclusion_probabilities(counts, TOP_K).ravel(), rtol=1e-6
    )
    assert np.isfinite(np.log1p(-fast_inclusion(peaked((0, 1)), TOP_K))).all()
    # Sampled layers: the same values, those rows only.
    rows = np.array([1], dtype=np.int64)
    np.testing.assert_allclose(
        sampled_inclusion(np.ascontiguousarray(counts), rows, TOP_K),
        inclusion_probabilities(counts, TOP_K)[rows].ravel(),
        rtol=1e-6,
    )


def test_spreads_when_nothing_overlaps() -> None:
    p = policy(workers=3)
    picks = [p.choose(req([0, 0, 0], A)) for _ in range(300)]
    assert set(Counter(picks)) == {0, 1, 2}  # empty workers are exact ties: random


def test_respects_batch_slots() -> None:
    p = policy(worker_slots=2)
    dispatch(p, 0, A, "a", [0, 0])
    dispatch(p, 0, A, "a2", [1, 0])
    dispatch(p, 1, B, "b", [2, 0])
    assert p.choose(req([2, 1], A)) == 1  # the overlapping worker has no free slot
    # Every worker full: the request queues where the queue is shortest.
    assert p.choose(req([3, 2], A)) == 1


def test_without_a_signature_it_is_least_loaded_with_random_ties() -> None:
    p = policy(workers=4)
    dispatch(p, 2, A, "a", [0, 0, 0, 0])
    # An all-zero table reaches a policy as no signature (the proxy's and simulator's rule).
    zero = routing_inputs(np.zeros((LAYERS, EXPERTS), np.int32), None).counts
    for counts in (None, zero):
        assert p.choose(req([3, 1, 2, 5], counts)) == 1
        picks = Counter(p.choose(req([1, 0, 0, 1], counts)) for _ in range(200))
        assert set(picks) == {1, 2}
    # Another model's shape predicts nothing here; so does a policy without top-k.
    assert p.choose(req([3, 1, 2, 5], np.ones((3, 4), np.int32))) == 1
    blind = EldrUnionPolicy(RoutingContext(4, top_k=None, cost=COST))
    assert blind.choose(req([3, 1, 2, 5], A)) == 1
    blind.on_dispatch(1, req([3, 1, 2, 5], A), "x")
    blind.on_complete(1, "x")


def test_never_picks_an_ineligible_worker() -> None:
    rng = np.random.default_rng(0)
    p = policy(workers=5, worker_slots=3)
    inflight: dict[int, int] = {}
    loads = np.zeros(5, np.int64)
    for key in range(400):
        eligible = rng.random(5) < 0.6
        if not eligible.any():
            eligible[rng.integers(5)] = True
        counts = [A, B, peaked((2, 3)), None][rng.integers(4)]
        r = RoutingRequest(loads=loads.copy(), eligible=eligible, counts=counts)
        w = p.choose(r)
        assert eligible[w]
        if (loads[eligible] < 3).any():
            assert loads[w] < 3
        p.on_dispatch(w, r, key)
        loads[w] += 1
        inflight[key] = w
        if len(inflight) > 8:
            done = min(inflight)
            p.on_complete(inflight[done], done)
            loads[inflight.pop(done)] -= 1


def test_decode_router_gives_it_counts_and_keys() -> None:
    art = domain_artifact(2)  # a prior for nothing here; it only says top-k and [L, E]
    router = DecodeRouter(2, "eldr-union", art)
    assert isinstance(router.policy, EldrUnionPolicy)
    assert router.policy.top_k == art.identity.top_k
    shape = art.identity.shape
    a = np.zeros(shape, np.int32)
    a[:, 3] = 10
    f = router.features(wire.encode(a))
    assert f.vector is None and not f.missing and f.counts is not None
    np.testing.assert_array_equal(f.counts, a)
    assert router.features(wire.encode(np.zeros(shape, np.int32))).missing
    assert router.features({"remote_engine_id": "x"}).missing
    b = np.zeros(shape, np.int32)
    b[:, 9] = 10
    loads = np.zeros(2, np.int64)
    decisions = []
    for counts in (a, b, a):
        decisions.append(router.choose(router.features(wire.encode(counts)), loads, loads >= 0))
        loads[decisions[-1].worker] += 1
    first, other, third = (d.worker for d in decisions)
    assert other != first and third == first  # the same experts again: where they run
    policy_before = router.policy
    router.set_policy("jsq")
    for d in decisions:
        d.on_complete(d.worker)  # the policy that counted it forgets it
    assert not policy_before._members
    router.set_policy("eldr-union")
    assert router.features(wire.encode(a)).counts is not None


def test_decode_router_without_artifact_routes_by_load() -> None:
    router = DecodeRouter(3, "eldr-union", None)
    a = np.ones((4, 16), np.int32)
    f = router.features(wire.encode(a))
    assert f.counts is not None  # decoded; top-k unknown, so the policy reads load only
    assert router.choose(f, np.array([2, 0, 1]), np.ones(3, bool)).worker == 1


def test_worker_unions_match_the_closed_form_through_joins_and_leaves() -> None:
    rng = np.random.default_rng(2)
    size = LAYERS * EXPERTS
    load = WorkerExpertLoad(2, size)
    members: dict[int, tuple[int, np.ndarray]] = {}
    for key in range(300):
        if members and rng.random() < 0.45:
            done = int(rng.choice(list(members)))
            worker, pi = members.pop(done)
            load.remove(worker, pi)
        else:
            worker = int(rng.integers(2))
            pi = fast_inclusion(rng.integers(0, 9, size=(LAYERS, EXPERTS)), TOP_K)
            load.add(worker, pi)
            members[key] = (worker, pi)
        for w in range(2):
            pis = [pi for (home, pi) in members.values() if home == w]
            miss = np.prod([1.0 - p.astype(np.float64) for p in pis] or [np.ones(size)], axis=0)
            assert load.distinct[w] == pytest.approx(size - np.sum(miss), rel=1e-5, abs=1e-5)
    # A miss product that underflows ("surely active") is rebuilt exactly at a completion.
    sure = fast_inclusion(peaked((0, 1)), TOP_K)
    for _ in range(60):
        load.add(0, sure)
    for _ in range(59):
        load.remove(0, sure)
    assert float(load.miss[0] @ sure) == pytest.approx(float((1.0 - sure) @ sure), abs=1e-6)
    assert np.isfinite(load.distinct).all()


def test_router_without_an_artifact_takes_top_k_from_the_served_model() -> None:
    router = DecodeRouter(2, "eldr-union", None, model_top_k=TOP_K)
    assert router.policy.top_k == TOP_K  # type: ignore[attr-defined]
    loads = np.zeros(2, np.int64)
    workers = []
    for experts in ((0, 1), (5, 6), (0, 1)):
        decision = router.choose(router.features(wire.encode(peaked(experts))), loads, loads >= 0)
        workers.append(decision.worker)
        loads[decision.worker] += 1
    assert workers[1] != workers[0] and workers[2] == workers[0]


def test_miss_chances_stay_out_of_float32_subnormals() -> None:
    # Requests that surely use every expert drive q = prod(1 - pi) below 1e-38 after a few
    # joins; subnormal q made every later decision ~10x slower.
    load = WorkerExpertLoad(2, 64)
    sure = np.full(64, np.float32(1.0 - 2.0**-24), dtype=np.float32)
    for _ in range(12):
        load.add(0, sure)
    tiny = np.finfo(np.float32).tiny
    assert float(load.miss[0] @ sure) == pytest.approx(0.0, abs=1e-20)
    assert (load.miss >= tiny).all()
    load.remove(0, sure)  # the exact rebuild from logs is floored too
    assert (load.miss >= tiny).all()
    assert load.distinct[0] == pytest.approx(64.0)


def test_cost_option_picks_the_model_it_weighs_with(tmp_path) -> None:
    # Batch slots free, experts dear: a shared expert is worth more load than with COST.
    experts_only = CostModel(num_layers=LAYERS, base_s=1e-3, per_token_s=0.0, per_expert_s=1e-2)
    path = tmp_path / "cost-model.json"
    experts_only.save(path)
    context = RoutingContext(2, top_k=TOP_K, cost=COST)

    def choice(params: UnionParams) -> int:
        # 25 requests share A's experts on worker 0, one B runs on worker 1; one more A comes.
        p = EldrUnionPolicy(context, params)
        dispatch(p, 1, B, "b", [0, 0])
        for i in range(25):
            dispatch(p, 0, A, f"a{i}", [i, 1])
        return p.choose(req([25, 1], A))

    assert choice(UnionParams(load_slack=100.0)) == 1  # COST: a batch slot outweighs experts
    assert choice(UnionParams(load_slack=100.0, cost=str(path))) == 0  # the file's: experts
    with pytest.raises(EldrError, match="cost"):
        UnionParams(cost=str(tmp_path / "missing.json"))
    other = CostModel(num_layers=LAYERS + 1, base_s=1e-3, per_token_s=0.0, per_expert_s=1e-2)
    other.save(tmp_path / "other.json")
    # Fitted on another model: the preset stands in, so it does not route as the file says.
    p = EldrUnionPolicy(context, UnionParams(cost=str(tmp_path / "other.json")))
    p.choose(req([0, 0], A))
    assert p._step is not None and p._step[1] > 0  # seconds per sequence: the preset's


def test_sampled_layers_stand_for_all_when_layers_route_alike() -> None:
    assert sampled_layers(48, 16).tolist() == [round(i * 47 / 15) for i in range(16)]
    assert sampled_layers(4, 16).tolist() == [0, 1, 2, 3]
    assert sampled_layers(48, 0).tolist() == list(range(48))
    with pytest.raises(EldrError, match="sample_layers"):
        UnionParams(sample_layers=-1)
    # peaked() routes every layer alike: one layer of two decides as both do, and its added
    # latency is the full one (its experts scaled by the layers it stands for).
    context = RoutingContext(2, top_k=TOP_K, cost=COST)
    full, one = EldrUnionPolicy(context), EldrUnionPolicy(context, UnionParams(sample_layers=1))
    for p in (full, one):
        dispatch(p, 0, A, "a", [0, 0])
        dispatch(p, 1, B, "b", [1, 0])
    np.testing.assert_allclose(added(one, A, [1, 1]), added(full, A, [1, 1]), rtol=1e-5)
    assert one._load is not None and one._load.size == EXPERTS


def test_a_peers_requests_are_weighed_by_their_experts_until_they_leave() -> None:
    router = DecodeRouter(2, "eldr-union", None, model_top_k=TOP_K)
    loads, healthy = np.array([1, 1], np.int64), np.ones(2, bool)

    def probe() -> set[int]:
        """Where a request with A's experts would go (the policy's pick, not dispatched)."""
        return {router.policy.choose(req(loads, A)) for _ in range(20)}

    assert probe() == {0, 1}  # two workers with one request each: nothing to tell them apart
    router.peer_joined(0, "other-a", wire.encode(A))  # another proxy's: A's experts on 0
    router.peer_joined(1, "other-b", wire.encode(B))
    router.peer_joined(1, "other-bad", {wire.SIGNATURE_KEY: "not base64"})  # load only
    assert router.peers_weighed == 2
    assert probe() == {0}
    router.set_policy("jsq")
    router.set_policy("eldr-union")  # a policy built later hears of them too
    assert probe() == {0}
    router.peer_left(0, "other-a")
    router.peer_left(1, "other-b")
    router.peer_left(1, "never-joined")
    assert router.peers_weighed == 0 and probe() == {0, 1}
    decision = router.choose(router.features(wire.encode(A)), loads, healthy)
    decision.on_complete(decision.worker)  # its own requests still come and go as before
