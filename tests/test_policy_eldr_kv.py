"""eldr-kv: the KV a worker holds, priced against its load and its experts in one objective."""

from __future__ import annotations

import numpy as np

from stages.routing.context import RoutingContext
from stages.routing.policies import PrefillRequest, RoutingRequest, make_policy

ALL = np.ones(3, dtype=bool)


def _policy(**params: object):
    return make_policy("eldr-kv", RoutingContext(3, seed=0, top_k=2), {"cost": "gpu", **params})


def test_decode_goes_where_the_history_is_when_loads_are_equal() -> None:
    policy = _policy()
    request = RoutingRequest(loads=np.zeros(3, dtype=np.int64), eligible=ALL, prompt_tokens=4096,
                             cached_tokens=np.array([0, 3968, 512]), output_tokens=64)
    assert policy.choose(request) == 1


def test_a_loaded_holder_loses_to_a_free_worker_when_the_pull_is_cheap() -> None:
    policy = _policy()
    loads = np.array([0, 6, 0], dtype=np.int64)
    request = RoutingRequest(loads=loads, eligible=ALL, prompt_tokens=256,
                             cached_tokens=np.array([0, 256, 0]), output_tokens=256)
    assert policy.choose(request) in (0, 2)


def test_experts_still_count_when_kv_is_equal() -> None:
    """With a signature and no KV difference, eldr-kv chooses as eldr-union does."""
    rng = np.random.default_rng(1)
    union = make_policy("eldr-union", RoutingContext(3, seed=0, top_k=2), {"cost": "gpu"})
    kv = _policy()
    loads = np.zeros(3, dtype=np.int64)
    for key in range(12):
        counts = rng.integers(0, 5, size=(4, 16)).astype(np.int16)
        request = RoutingRequest(loads=loads.copy(), eligible=ALL, counts=counts)
        a, b = union.choose(request), kv.choose(request)
        assert a == b
        union.on_dispatch(a, request, key)
        kv.on_dispatch(a, request, key)
        loads[a] += 1


def test_prefill_prices_the_uncached_tokens_against_the_queue() -> None:
    policy = _policy()
    request = PrefillRequest(loads=np.array([0, 0]), eligible=np.ones(2, dtype=bool),
                             prompt_tokens=2000, cached_tokens=np.array([0, 1920]),
                             queued_tokens=np.array([0, 0]))
    assert policy.choose_prefill(request) == 1
    busy = request._replace(loads=np.array([0, 4]), queued_tokens=np.array([0, 8000]))
    assert policy.choose_prefill(busy) == 0


def test_full_workers_are_skipped_while_another_has_room() -> None:
    policy = make_policy("eldr-kv", RoutingContext(3, seed=0, top_k=2, worker_slots=2),
                         {"cost": "gpu"})
    request = RoutingRequest(loads=np.array([2, 0, 1], dtype=np.int64), eligible=ALL,
                             prompt_tokens=4096, cached_tokens=np.array([4096, 0, 0]))
    assert policy.choose(request) != 0


def test_the_kv_only_yardstick_ignores_experts_but_not_the_kv() -> None:
    policy = make_policy("kv", RoutingContext(3, seed=0, top_k=2), {"cost": "gpu"})
    counts = np.zeros((4, 16), dtype=np.int16)
    counts[:, :2] = 5
    request = RoutingRequest(loads=np.zeros(3, dtype=np.int64), eligible=ALL, counts=counts,
                             prompt_tokens=4096, cached_tokens=np.array([0, 0, 4096]))
    assert policy.choose(request) == 2
    policy.on_dispatch(2, request, "a")  # counted by the proxy's loads only
    policy.on_complete(2, "a")


def _prefill(cached: int, queued: int = 0) -> PrefillRequest:
    return PrefillRequest(loads=np.zeros(2, dtype=np.int64), eligible=np.ones(2, dtype=bool),
                          prompt_tokens=2000, cached_tokens=np.array([cached, 0]),
                          queued_tokens=np.array([queued, 0]))


def test_a_decode_worker_holding_the_history_prefills_the_new_turn_itself() -> None:
    policy = _policy()
    request = RoutingRequest(loads=np.zeros(3, dtype=np.int64), eligible=ALL, prompt_tokens=2000,
                             cached_tokens=np.array([0, 1792, 0]), output_tokens=64)
    # 208 tokens to compute where it is, against a remote prefill of them and their pull.
    policy = _policy(local_prefill_below=512)
    assert policy.choose_local(request, _prefill(cached=1536)) == 1
    # Lacking more than the cap: the PD path.
    capped = _policy(local_prefill_below=128)
    assert capped.choose_local(request, _prefill(cached=1536)) is None
    # A busy batch pays for the stall: the PD path.
    busy = request._replace(loads=np.array([0, 30, 0]))
    assert policy.choose_local(busy, _prefill(cached=1536)) is None
    assert _policy().choose_local(request, _prefill(cached=1536)) is None  # off by default


def _busy(policy, workers: tuple[int, ...]) -> np.ndarray:
    """One request with a signature (every expert alike) dispatched to each of ``workers``;
    the loads that leaves."""
    loads = np.zeros(3, dtype=np.int64)
    for key, worker in enumerate(workers):
        request = RoutingRequest(loads=loads.copy(), eligible=ALL,
                                 counts=np.ones((4, 16), dtype=np.int16), output_tokens=256)
        policy.choose(request)
        policy.on_dispatch(worker, request, key)
        loads[worker] += 1
    return loads


def test_a_local_prefill_pays_for_the_experts_it_adds_to_a_busy_holder() -> None:
    """A request prefilled where it arrives has no signature yet: it is priced as the mean
    request seen, so the experts it adds to the holder's running request count, not only a
    batch slot (blind to experts the holder looked ~0.1 ms a step dearer than a free worker,
    and later turns crowded onto busy holders: TPOT p99 +7.7% in the simulation)."""
    request = RoutingRequest(loads=np.zeros(3, dtype=np.int64), eligible=ALL, prompt_tokens=2000,
                             cached_tokens=np.array([0, 1904, 0]), output_tokens=256)
    policy = _policy(local_prefill_below=512)
    busy = request._replace(loads=_busy(policy, (1,)))
    assert policy.choose_local(busy, _prefill(cached=1536)) is None
    # Every worker runs one: the holder costs no more than the others, and the stall of 96
    # tokens is cheaper than a prefill worker's 464 and the pull.
    policy = _policy(local_prefill_below=512)
    alike = request._replace(loads=_busy(policy, (0, 1, 2)))
    assert policy.choose_local(alike, _prefill(cached=1536)) == 1


def test_local_prefill_needs_to_know_the_kv() -> None:
    request = RoutingRequest(loads=np.zeros(3, dtype=np.int64), eligible=ALL)
    assert _policy(local_prefill_below=512).choose_local(request, _prefill(cached=0)) is None


def _older_worker_chosen(name: str, counts: np.ndarray | None, seed: int,
                         finished_before: int = 0) -> int:
    """Two workers, one request each, equal loads: worker 0's joined a decision earlier, so
    it leaves first. Which does a third request of the same length go to? ``finished_before``
    requests ran on worker 0 and completed first."""
    policy = make_policy(name, RoutingContext(2, seed=seed, top_k=2), {"cost": "gpu"})
    loads = np.zeros(2, dtype=np.int64)
    for key in range(finished_before):
        policy.on_dispatch(0, RoutingRequest(loads=loads.copy(), eligible=np.ones(2, dtype=bool),
                                             output_tokens=100), key)
    for key in range(finished_before):
        policy.on_complete(0, key)
    for worker, key in ((0, "a"), (1, "b")):
        request = RoutingRequest(loads=loads.copy(), eligible=np.ones(2, dtype=bool),
                                 counts=counts, output_tokens=100)
        policy.choose(request)
        policy.on_dispatch(worker, request, key)
        loads[worker] += 1
    return policy.choose(RoutingRequest(loads=loads, eligible=np.ones(2, dtype=bool),
                                        counts=counts, output_tokens=100))


def test_equal_loads_the_worker_whose_requests_end_sooner_wins() -> None:
    """eldr-kv weighs a worker's requests by the steps they will share with the new one (by
    Little's law, from the decisions since they joined), not by how many run now."""
    counts = np.zeros((4, 16), dtype=np.int16)
    counts[:, :4] = 3
    for seed in range(8):
        assert _older_worker_chosen("eldr-kv", None, seed) == 0
        assert _older_worker_chosen("eldr-kv", counts, seed) == 0


def test_the_kv_only_yardstick_counts_requests_in_flight_as_the_kv_routers_do() -> None:
    assert {_older_worker_chosen("kv", None, seed) for seed in range(16)} == {0, 1}


def test_completed_requests_no_longer_count_however_many_came_before() -> None:
    for seed in range(4):
        assert _older_worker_chosen("eldr-kv", None, seed, finished_before=150) == 0


def test_an_idle_worker_beats_a_busy_one_whose_request_is_about_to_end() -> None:
    """Worker 1's one request is overdue (it shares no steps with the new one), so the two
    cost the same per token; the new request would still wait for worker 1's running step
    (``scorers.step_wait``), and not at all on idle worker 0."""
    two = np.ones(2, dtype=bool)
    for seed in range(16):
        policy = make_policy("eldr-kv", RoutingContext(2, seed=seed, top_k=2), {"cost": "gpu"})
        first = RoutingRequest(loads=np.zeros(2, dtype=np.int64), eligible=two, output_tokens=1)
        policy.on_dispatch(1, first, "first")
        assert policy.choose(RoutingRequest(loads=np.array([0, 1]), eligible=two,
                                            output_tokens=1)) == 0


def test_the_proxys_router_gives_the_running_step_term_what_it_needs() -> None:
    """Through the proxy's DecodeRouter: the loads it passes and the dispatches the policy
    heard tell it which worker is busy, so the next request goes to the idle one."""
    from stages.routing.policy_config import PolicyConfig
    from stages.serve.proxy.router.decode_router import NO_FEATURES, DecodeRouter, KVInputs

    two = np.ones(2, dtype=bool)
    config = PolicyConfig.from_mapping({"eldr-kv": {"cost": "gpu"}})
    for seed in range(16):
        router = DecodeRouter(2, "eldr-kv", None, seed=seed, policy_config=config)
        first = router.choose(NO_FEATURES, np.zeros(2, dtype=np.int64), two,
                              KVInputs(output_tokens=1))
        loads = np.zeros(2, dtype=np.int64)
        loads[first.worker] = 1
        second = router.choose(NO_FEATURES, loads, two, KVInputs(output_tokens=1))
        assert second.worker == 1 - first.worker
