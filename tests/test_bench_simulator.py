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
