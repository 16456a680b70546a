"""The discrete-event simulator: conservation, determinism, and that locality pays."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from stages.bench.live.arrivals import poisson_arrivals_until
from stages.bench.sim.expert_union import DecodeProfiles, ExpertUnion
from stages.bench.sim.simulator import SimConfig, simulate, simulate_sweep
from stages.bench.sim.synthetic import SyntheticSpec, stand_in_artifact, synthetic_signatures
from stages.errors import EldrError
from stages.routing.cost_model import CostModel
from stages.signature.dataset import SignatureArrays

SPEC = SyntheticSpec(
    num_requests=400,
    num_layers=4,
    num_experts=32,
    top_k=2,
    num_domains=4,
    domain_experts=6,
    domain_weight=0.9,
    min_output=16,
    max_output=48,
    prompt_median=64,
    seed=1,
)


@pytest.fixture(scope="module")
def arrays() -> SignatureArrays:
    return synthetic_signatures(SPEC)


@pytest.fixture(scope="module")
def artifact(arrays: SignatureArrays):
    return stand_in_artifact(arrays, k=4, seed=0)


# Slow decode steps (tens of ms) so batches hold tens of requests, where locality shows.
COST = CostModel(
    num_layers=SPEC.num_layers,
    base_s=0.01,
    per_token_s=1e-4,
    per_expert_s=1e-3,
    prefill_base_s=0.005,
    prefill_per_token_s=1e-5,
)


def _config(**kw) -> SimConfig:
    base = SimConfig(
        cost=COST,
        num_prefill=2,
        num_decode=4,
        request_rate=40.0,
        duration_s=10.0,
        max_batch=32,
        seed=3,
    )
    return replace(base, **kw)


def test_every_request_completes_and_every_token_is_accounted(arrays, artifact) -> None:
    config = _config()
    expected = poisson_arrivals_until(config.request_rate, config.duration_s, config.seed).size
    results = simulate(config, arrays, artifact, top_k=SPEC.top_k)
    assert list(results) == list(config.policies)
    totals = set()
    for result in results.values():
        m, table = result.metrics, result.table
        assert m["completed"] == expected and m["failed"] == 0
        totals.add(m["total_output_tokens"])
        # One ITL per token after the first, and they add up to each request's decode time.
        assert table.itl_s.size == int((table.output_tokens - 1).sum())
        assert table.itl_s.sum() == pytest.approx((table.latency_s - table.ttft_s).sum())
        assert np.all(table.itl_s > 0)
        assert 0 < m["mean_decode_batch"] <= config.max_batch
    assert len(totals) == 1  # the same requests for every policy


def test_open_loop_prefill_does_not_depend_on_the_decode_policy(arrays, artifact) -> None:
    # With the prefill's token streamed, TTFT is the prefill's end: the same for every policy
    # while nothing caps the requests in flight.
    config = _config(first_token_from_prefill=True)
    results = simulate(config, arrays, artifact, top_k=SPEC.top_k)
    ttfts = [r.table.ttft_s for r in results.values()]
    for other in ttfts[1:]:
        assert np.array_equal(ttfts[0], other)


def test_deterministic_for_a_seed(arrays, artifact) -> None:
    a = simulate(_config(policies=("random", "eldr")), arrays, artifact, top_k=SPEC.top_k)
    b = simulate(_config(policies=("random", "eldr")), arrays, artifact, top_k=SPEC.top_k)
    for name in a:
        assert a[name].metrics == pytest.approx(b[name].metrics, nan_ok=True)


def test_locality_policy_activates_fewer_experts_and_decodes_faster(arrays, artifact) -> None:
    config = _config(policies=("eldr", "random", "rr"), request_rate=80.0)
    results = simulate(config, arrays, artifact, top_k=SPEC.top_k)
    eldr, rand, rr = (results[p].metrics for p in ("eldr", "random", "rr"))
    assert eldr["distinct_experts_per_layer"] < 0.9 * rand["distinct_experts_per_layer"]
    assert eldr["distinct_experts_per_layer"] < 0.9 * rr["distinct_experts_per_layer"]
    assert eldr["median_tpot_ms"] < rand["median_tpot_ms"]


def test_batch_cap_holds_under_overload(arrays, artifact) -> None:
    results = simulate(
        _config(policies=("jsq",), max_batch=2, request_rate=100.0, duration_s=3.0),
        arrays,
        artifact,
        top_k=SPEC.top_k,
    )
    m = results["jsq"].metrics
    assert m["mean_decode_batch"] <= 2.0
    assert m["completed"] == poisson_arrivals_until(100.0, 3.0, 3).size


def test_first_token_from_decode_moves_ttft_not_conservation(arrays, artifact) -> None:
    config = _config(policies=("rr",))
    from_decode = simulate(config, arrays, artifact, top_k=SPEC.top_k)["rr"]  # as the proxy
    from_prefill = simulate(
        replace(config, first_token_from_prefill=True), arrays, artifact, top_k=SPEC.top_k
    )["rr"]
    assert np.all(from_decode.table.ttft_s > from_prefill.table.ttft_s)
    t = from_decode.table
    assert t.itl_s.size == int((t.output_tokens - 1).sum())


def test_warmup_excludes_early_arrivals(arrays, artifact) -> None:
    config = _config(policies=("rr",), warmup_s=5.0)
    arrivals = poisson_arrivals_until(config.request_rate, config.duration_s, config.seed)
    m = simulate(config, arrays, artifact, top_k=SPEC.top_k)["rr"].metrics
    assert m["completed"] == int((arrivals >= 5.0).sum())


def test_user_errors(arrays) -> None:
    with pytest.raises(EldrError, match="needs a fitted artifact"):
        simulate(_config(), arrays, None, top_k=SPEC.top_k)
    wrong = CostModel(num_layers=7, base_s=0.01, per_token_s=0.0, per_expert_s=0.0)
    with pytest.raises(EldrError, match="7 MoE layers"):
        simulate(_config(cost=wrong, policies=("rr",)), arrays, None, top_k=SPEC.top_k)
    with pytest.raises(EldrError, match="unknown policy"):
        _config(policies=("nope",))


def test_expected_distinct_matches_monte_carlo() -> None:
    """Each request's tokens pick k of its own m experts uniformly (pi = k/m on them)."""
    rng = np.random.default_rng(0)
    num_layers, num_experts, k, m, batch = 3, 40, 2, 5, 6
    sets = [
        [rng.choice(num_experts, m, replace=False) for _ in range(num_layers)] for _ in range(batch)
    ]
    decode = np.zeros((batch, num_layers, num_experts), np.int32)
    for r, layers in enumerate(sets):
        for layer, experts in enumerate(layers):
            decode[r, layer, experts] = 10 * k  # 10*m tokens, each expert in k/m of them
    profiles = DecodeProfiles(decode, decode, top_k=k)
    union = ExpertUnion(num_layers * num_experts, num_layers * k)
    for r in range(batch):
        union.add(profiles.log_complement(r))
    trials = []
    for _ in range(4000):
        active = set()
        for layers in sets:
            for layer, experts in enumerate(layers):
                active.update((layer, int(e)) for e in rng.choice(experts, k, replace=False))
        trials.append(len(active))
    assert union.mean() == pytest.approx(np.mean(trials), rel=0.01)
    # Removing every member returns to an empty batch exactly.
    for r in range(batch):
        union.remove(profiles.log_complement(r))
    assert union.mean() == 0.0


def test_sweep_more_load_slower_decode(arrays, artifact) -> None:
    sweep = simulate_sweep(
        _config(policies=("rr",)), arrays, artifact, [10.0, 80.0], top_k=SPEC.top_k
    )
    assert [c.request_rate for c in sweep] == [10.0, 80.0]
    low, high = (c.results["rr"].metrics for c in sweep)
    assert high["mean_decode_batch"] > low["mean_decode_batch"]
    assert high["median_tpot_ms"] > low["median_tpot_ms"]
    assert high["distinct_experts_per_layer"] > low["distinct_experts_per_layer"]


def test_batch_aware_policy_does_no_harm_without_locality(arrays, artifact) -> None:
    balancers = ("rr", "jsq", "random", "p2c")
    config = _config(
        policies=("eldr-union", *balancers), request_rate=40.0, duration_s=20.0,
        locality_blend=1.0,
    )
    results = simulate(config, arrays, artifact, top_k=SPEC.top_k)
    union = results["eldr-union"].metrics
    for key in ("median_tpot_ms", "p99_tpot_ms"):
        best = min(results[p].metrics[key] for p in balancers)
        assert union[key] <= 1.03 * best, key


# -- several routing proxies on a delayed view ------------------------------------------------

# Decode steps priced by the batch alone (no expert term): TPOT follows how evenly the load is
# spread, so a herd on one worker shows in it.
BATCH_COST = CostModel(
    num_layers=SPEC.num_layers,
    base_s=0.005,
    per_token_s=2e-3,
    per_expert_s=0.0,
    prefill_base_s=0.005,
    prefill_per_token_s=1e-5,
)


def test_one_proxy_is_the_simulator_before_proxies(arrays, artifact) -> None:
    """The figures of this configuration before proxies were modelled (commit c2f5e26): one
    proxy takes the very same path. A deliberate change to the model updates them."""
    config = _config(policies=("jsq", "eldr"))
    before = {
        "jsq": (463, 81.97911754188641, 88.7772038414499, 881.854589843404),
        "eldr": (622, 55.641024726099005, 80.86714251999321, 629.6455355748577),
    }
    results = simulate(config, arrays, artifact, top_k=SPEC.top_k)
    # A publish delay means nothing to a lone proxy: it hears of everything at once.
    delayed = simulate(replace(config, publish_delay_s=0.5), arrays, artifact, top_k=SPEC.top_k)
    for name, (steps, p50, p99, itl) in before.items():
        m = results[name].metrics
        assert m["decode_steps"] == steps
        assert m["median_tpot_ms"] == pytest.approx(p50, rel=1e-12)
        assert m["p99_tpot_ms"] == pytest.approx(p99, rel=1e-12)
        assert float(results[name].table.itl_s.sum()) == pytest.approx(itl, rel=1e-12)
        assert np.array_equal(delayed[name].table.itl_s, results[name].table.itl_s)


def test_proxies_without_delay_route_as_one(arrays, artifact) -> None:
    """With nothing to publish late every proxy routes on the true loads. ``eldr`` decides by
    loads and signature alone, so four proxies make exactly one proxy's choices. ``jsq`` breaks
    ties at random, and four proxies draw them from four seeded streams instead of one: its
    choices differ on ties, not its figures beyond noise."""
    one = simulate(_config(policies=("eldr", "jsq")), arrays, artifact, top_k=SPEC.top_k)
    four = simulate(_config(policies=("eldr", "jsq"), proxies=4), arrays, artifact,
                    top_k=SPEC.top_k)
    for field_name in ("ttft_s", "latency_s", "itl_s"):
        assert np.array_equal(getattr(one["eldr"].table, field_name),
                              getattr(four["eldr"].table, field_name))
    assert not np.array_equal(one["jsq"].table.itl_s, four["jsq"].table.itl_s)
    a, b = one["jsq"].metrics, four["jsq"].metrics
    assert b["completed"] == a["completed"]
    for key in ("median_tpot_ms", "p99_tpot_ms", "mean_decode_batch"):
        assert b[key] == pytest.approx(a[key], rel=0.03), key


def test_stale_views_herd_a_load_balancer(arrays) -> None:
    """Eight proxies that see one another's assignments 2 s late pile requests on the workers
    that looked idle: the spread of in-flight counts and TPOT p99 grow; without a delay they
    do not."""
    config = _config(cost=BATCH_COST, policies=("jsq",), num_decode=8, request_rate=80.0,
                     max_batch=64)

    def run(proxies: int, delay_s: float) -> dict[str, float]:
        staged = replace(config, proxies=proxies, publish_delay_s=delay_s)
        return simulate(staged, arrays, None, top_k=SPEC.top_k)["jsq"].metrics

    one, fresh, stale = run(1, 0.0), run(8, 0.0), run(8, 2.0)
    assert fresh["mean_decode_load_spread"] < 1.2 * one["mean_decode_load_spread"]
    assert stale["mean_decode_load_spread"] > 2.0 * one["mean_decode_load_spread"]
    assert fresh["p99_tpot_ms"] < 1.1 * one["p99_tpot_ms"]
    assert stale["p99_tpot_ms"] > 2.0 * one["p99_tpot_ms"]
    assert stale["completed"] == one["completed"]


def test_a_proxy_hears_of_completions_only_after_dispatches() -> None:
    from stages.bench.sim.proxy_views import COMPLETED, DISPATCHED, ProxyViews, proxy_seeds
    from stages.routing.context import RoutingContext
    from stages.routing.policies import RoutingRequest, make_policy

    seeds = proxy_seeds(7, 3)
    assert seeds[0] == 7 and len(set(seeds)) == 3 and seeds == proxy_seeds(7, 3)
    views = ProxyViews([make_policy("jsq", RoutingContext(2, seed=s)) for s in seeds[:2]], 2)
    request = RoutingRequest(np.zeros(2, np.int64), np.ones(2, bool))
    views.dispatch(views.proxy_of(5), 1, 5, request)  # proxy 1 of 2 takes request 5
    assert [v.tolist() for v in views.loads] == [[0, 0], [0, 1]]
    with pytest.raises(AssertionError, match="completed before"):
        views.publish(COMPLETED, 1, 5)
    views.publish(DISPATCHED, 1, 5)
    assert [v.tolist() for v in views.loads] == [[0, 1], [0, 1]]
    views.complete(1, 1, 5)
    views.publish(COMPLETED, 1, 5)
    assert [v.tolist() for v in views.loads] == [[0, 0], [0, 0]]
    with pytest.raises(AssertionError, match="would count -1"):
        views.complete(0, 1, 5)


@pytest.mark.parametrize(("field_name", "value", "message"), [
    ("proxies", 0, "at least one proxy"),
    ("publish_delay_s", -0.001, "publish delay"),
    ("publish_delay_s", float("nan"), "publish delay"),
    ("publish_delay_s", float("inf"), "publish delay"),
])
def test_proxy_settings_are_checked(field_name: str, value: float, message: str) -> None:
    with pytest.raises(EldrError, match=message):
        _config(**{field_name: value})
