"""Replaying a live run in the simulator: closed-loop admission, shared cores, the proxy's
first-token accounting, reading a results folder back, and `eldr bench --simulate --replay`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pytest

from stages.bench.metrics import RequestRecord, RequestTable
from stages.bench.replay.saved_run import load_live_runs, replay_workloads
from stages.bench.replay.validation import Compared, validate
from stages.bench.replay.worker_cores import live_core_plan
from stages.bench.results import ComparisonResult, PolicyResult, save_comparison
from stages.bench.sim.shared_cores import SharedCores, core_groups
from stages.bench.sim.sim_workload import workload_of
from stages.bench.sim.simulator import SimConfig, simulate, simulate_segments
from stages.bench.sim.synthetic import SyntheticSpec, synthetic_signatures
from stages.errors import EldrError
from stages.routing.cost_model import CostModel
from stages.signature.dataset import SignatureArrays

SPEC = SyntheticSpec(
    num_requests=120, num_layers=2, num_experts=8, top_k=2, num_domains=2, domain_experts=3,
    min_output=8, max_output=16, prompt_median=32, seed=4,
)
COST = CostModel(
    num_layers=2, base_s=0.01, per_token_s=1e-3, per_expert_s=2e-3, prefill_base_s=0.004,
    prefill_per_token_s=1e-5,
)
# Every step and prefill takes exactly these, whatever the batch: timings checkable by hand.
STEP_S, PREFILL_S, KV_S = 0.1, 0.02, 0.005
FLAT = CostModel(num_layers=2, base_s=STEP_S, per_token_s=0.0, per_expert_s=0.0,
                 prefill_base_s=PREFILL_S, prefill_per_token_s=0.0)


@pytest.fixture(scope="module")
def arrays() -> SignatureArrays:
    return synthetic_signatures(SPEC)


def _config(**kw) -> SimConfig:
    base = SimConfig(cost=COST, num_prefill=1, num_decode=2, request_rate=50.0, duration_s=4.0,
                     max_batch=8, policies=("rr", "jsq"), seed=2)
    return replace(base, **kw)


def _one_worker(arrays: SignatureArrays, arrival: list[float], tokens: int, **kw):
    """A 1P1D run of FLAT on rows 0.. arriving at ``arrival``, each ``tokens`` long."""
    n = len(arrival)
    workload = workload_of(arrays, np.array(arrival), np.arange(n), np.full(n, 10),
                           np.full(n, tokens), None)
    config = _config(cost=FLAT, num_decode=1, policies=("rr",), kv_transfer_s=KV_S,
                     step_noise=False, **kw)
    return simulate_segments(config, arrays, None, {"rr": [workload]}, top_k=SPEC.top_k)["rr"]


# -- closed loop -----------------------------------------------------------------------------
def test_closed_loop_never_exceeds_the_cap(arrays) -> None:
    config = _config(request_rate=200.0, duration_s=1.0, max_concurrency=5)
    for result in simulate(config, arrays, None, top_k=SPEC.top_k).values():
        assert result.metrics["max_concurrent_requests"] == 5  # overloaded: always full
        assert result.metrics["completed"] == len(result.table)
    open_loop = simulate(replace(config, max_concurrency=None), arrays, None, top_k=SPEC.top_k)
    assert open_loop["rr"].metrics["max_concurrent_requests"] > 5


def test_closed_loop_is_open_loop_when_the_cap_never_binds(arrays) -> None:
    config = _config()
    open_loop = simulate(config, arrays, None, top_k=SPEC.top_k)
    capped = simulate(replace(config, max_concurrency=10_000), arrays, None, top_k=SPEC.top_k)
    for name in config.policies:
        assert capped[name].metrics == pytest.approx(open_loop[name].metrics, nan_ok=True)


def test_a_capped_request_waits_and_its_wait_is_not_in_its_latency(arrays) -> None:
    # Both arrive at 0 with one slot: the second is sent when the first is done.
    alone = _one_worker(arrays, [0.0], 4)
    capped = _one_worker(arrays, [0.0, 0.0], 4, max_concurrency=1)
    assert capped.table.latency_s == pytest.approx([alone.table.latency_s[0]] * 2)


# -- shared cores ----------------------------------------------------------------------------
def test_processor_sharing_two_busy_take_twice_as_long_a_lone_one_normal_speed() -> None:
    cores = SharedCores((0, 0), mode="busy")
    [a] = cores.begin(0, 0.0, 1.0)
    assert a.at == pytest.approx(1.0)  # alone on its core
    ends = {e.worker: e for e in cores.begin(1, 0.0, 1.0)}
    assert ends[0].at == pytest.approx(2.0) and ends[1].at == pytest.approx(2.0)
    assert not cores.current(a)  # superseded by the rescheduled end
    # Worker 0 finishes at 2; worker 1, given 1.5 s of work at 0.5, has 0.5 s left at 2.
    cores = SharedCores((0, 0), mode="busy")
    cores.begin(0, 0.0, 1.0)
    cores.begin(1, 0.0, 1.5)
    [rest] = cores.end(0, 2.0)
    assert rest.worker == 1 and rest.at == pytest.approx(2.5)


def test_bound_workers_keep_their_share_and_separate_cores_never_slow() -> None:
    cores = SharedCores((0, 0, 1), mode="bound")
    [lone] = cores.begin(0, 0.0, 1.0)
    assert lone.at == pytest.approx(2.0)  # the idle neighbour still holds half the core
    assert [e.worker for e in cores.begin(1, 0.0, 1.0)] == [1]  # nothing else moves
    [own] = cores.begin(2, 0.0, 1.0)
    assert own.at == pytest.approx(1.0)
    assert cores.end(0, 2.0) == []


def test_a_cost_measured_on_a_shared_core_is_not_shared_twice(arrays) -> None:
    """A model measured on one of two workers bound to a core, replayed on that binding,
    steps exactly as measured; with a core each, twice as fast."""
    config = _config(step_noise=False)
    measured = replace(COST, base_s=2 * COST.base_s, per_token_s=2 * COST.per_token_s,
                       per_expert_s=2 * COST.per_expert_s, core_sharing=2)
    as_measured = simulate(replace(config, cost=replace(measured, core_sharing=1)), arrays,
                           None, top_k=SPEC.top_k)
    shared = simulate(replace(config, cost=measured, decode_cores=(0, 0)), arrays, None,
                      top_k=SPEC.top_k)
    own = simulate(replace(config, cost=measured), arrays, None, top_k=SPEC.top_k)
    for name in config.policies:
        assert shared[name].metrics == pytest.approx(as_measured[name].metrics, nan_ok=True)
        assert own[name].metrics["mean_decode_step_ms"] < 0.6 * (
            shared[name].metrics["mean_decode_step_ms"])
    # Idle workers yielding their share: between a core each and always halved.
    busy = simulate(replace(config, cost=measured, decode_cores=(0, 0), core_sharing="busy"),
                    arrays, None, top_k=SPEC.top_k)
    for name in config.policies:
        step = busy[name].metrics["mean_decode_step_ms"]
        assert own[name].metrics["mean_decode_step_ms"] < step
        assert step < shared[name].metrics["mean_decode_step_ms"]


def test_core_groups_from_bindings() -> None:
    assert core_groups(["0", "1", "1", None]) == (0, 1, 1, -4)
    with pytest.raises(EldrError, match="overlap"):
        core_groups(["0-1", "1"])
    plan = live_core_plan(1, 2, ("0", "1", "1"))
    assert plan.decode_groups == (0, 0) and not plan.prefill_shares_decode_cores()
    assert live_core_plan(1, 1, ("0", "0")).prefill_shares_decode_cores()
    with pytest.raises(EldrError, match="3 workers"):
        live_core_plan(1, 2, ("0", "1"))


# -- first token -----------------------------------------------------------------------------
def test_the_decode_worker_makes_every_token_as_the_proxy_streams_them(arrays) -> None:
    r = _one_worker(arrays, [0.0], 5)
    # Prefill, the KV pull on an idle worker, then five steps: the first makes the first token.
    ttft = PREFILL_S + KV_S + STEP_S
    assert r.table.ttft_s == pytest.approx([ttft])
    assert r.table.latency_s == pytest.approx([ttft + 4 * STEP_S])
    assert r.table.itl_s == pytest.approx([STEP_S] * 4)
    streamed = _one_worker(arrays, [0.0], 5, first_token_from_prefill=True)
    assert streamed.table.ttft_s == pytest.approx([PREFILL_S])
    assert streamed.table.latency_s == pytest.approx([ttft + 3 * STEP_S])
    assert streamed.table.itl_s.size == 4


def test_a_request_reaching_a_busy_worker_joins_after_its_kv_pull(arrays) -> None:
    """vLLM starts the pull at the next step boundary and sees it done at the end of that
    step, so the request's first step is the one after."""
    arrive = 0.05  # its prefill ends mid the first request's first step
    r = _one_worker(arrays, [0.0, arrive], 6)
    first_step_starts = PREFILL_S + KV_S
    joined_at = first_step_starts + 2 * STEP_S
    assert r.table.ttft_s[1] == pytest.approx(joined_at + STEP_S - arrive)
    # Eight steps (the second request's six start at the third); decode-only: all but the
    # two a request joined in, as the workers' counters count them.
    assert r.metrics["decode_steps"] == 6


# -- replay ----------------------------------------------------------------------------------
def _live_results(folder: Path, ids: list[str], *, with_ids: bool = True, warmup: float = 0.0,
                  rounds: int = 2, policies: tuple[str, ...] = ("rr", "jsq"),
                  seed: int | None = 0) -> None:
    """What `eldr bench` saves: every request of every round, per policy, in plan order
    (``seed`` None: as saved before the bench seeded each round's policy)."""
    from stages.bench.live.loadgen import interleaved_plan

    arrival = np.cumsum(np.full(len(ids), 0.05)) - 0.05
    plan = interleaved_plan(len(ids), policies, rounds, seed or 0)
    results = {}
    for name in policies:
        records = []
        for seg in (s for s in plan if s.policy == name):
            for i in range(seg.start, seg.stop):
                offset = arrival[i] - arrival[seg.start]
                queue = 0.01 * (i % 3)
                records.append(RequestRecord(
                    request_id=f"{name}-{i}", success=True, prompt_tokens=30, output_tokens=12,
                    ttft_s=0.2, latency_s=1.3, itl_s=(0.1,) * 11, start_s=offset + queue,
                    prompt_id=ids[i] if with_ids else "", queue_s=queue,
                ))
        table = RequestTable.from_records(records)
        metrics = {"median_tpot_ms": 100.0, "p99_tpot_ms": 110.0, "median_itl_ms": 100.0,
                   "p99_itl_ms": 120.0, "distinct_experts_per_layer": 4.0, "median_ttft_ms": 200.0}
        results[name] = PolicyResult(name, metrics, table, tuple(records))
    state = {"prefill_workers": [{"index": 0}], "decode_workers": [{"index": 0}, {"index": 1}],
             "artifact_version": None, "config": {}}
    info = {"num_prompts": len(ids), "max_concurrency": 4, "max_tokens": 12, "seed": 0,
            "rounds": rounds, "warmup_s": warmup, "decode_urls": ["a", "b"],
            "policy_order": [s.policy for s in plan],
            "proxy_state": {p: state for p in policies}}
    if seed is not None:
        info["seed"] = seed
        info["policy_seeds"] = [s.policy_seed for s in plan]
    save_comparison(ComparisonResult(3.0, results, info), folder)


def test_replay_reads_back_arrivals_prompts_lengths_cap_and_workers(arrays, tmp_path) -> None:
    ids = [str(i) for i in arrays.ids[:10]]
    _live_results(tmp_path, ids)
    (run,) = load_live_runs(tmp_path)
    assert run.policies == ("rr", "jsq") and run.shape == "1P2D"
    assert run.max_concurrency == 4 and run.max_tokens == 12 and run.request_rate == 3.0
    segments = run.segments["jsq"]
    assert [s.round for s in segments] == [0, 1]
    assert segments[0].prompt_ids == tuple(ids[:5]) and segments[1].prompt_ids == tuple(ids[5:])
    # Scheduled arrival = send - client-side queueing, from each round's start.
    assert segments[1].arrival_s == pytest.approx(np.arange(5) * 0.05)
    assert list(segments[0].output_tokens) == [12] * 5
    assert segments[0].tpot_s == pytest.approx([0.1] * 5)  # (1.3 - 0.2) / 11
    assert run.metrics["rr"]["median_tpot_ms"] == 100.0
    workloads = replay_workloads(run, arrays, None)
    assert list(workloads["rr"][1].rows) == [5, 6, 7, 8, 9]


def test_results_without_timings_replay_with_no_round_scatter(arrays, tmp_path) -> None:
    from stages.bench.replay.round_scatter import round_scatter

    ids = [str(i) for i in arrays.ids[:10]]
    _live_results(tmp_path, ids)
    for name in ("rr", "jsq"):  # as a results file that kept no per-request timings
        path = tmp_path / f"{name}-3qps.json"
        data = orjson.loads(path.read_bytes())
        del data["latencies"]
        data["ttfts"] = data["ttfts"][:-1]  # garbled: one short
        path.write_bytes(orjson.dumps(data))
    (run,) = load_live_runs(tmp_path)
    assert all(np.isnan(s.tpot_s).all() for segs in run.segments.values() for s in segs)
    live = {name: [s.tpot_s for s in segs] for name, segs in run.segments.items()}
    assert round_scatter(live, live) is None


def test_replay_builds_each_round_on_its_recorded_policy_seed(arrays, tmp_path) -> None:
    ids = [str(i) for i in arrays.ids[:12]]
    _live_results(tmp_path / "new", ids, seed=4, rounds=3, policies=("random", "rr"))
    (run,) = load_live_runs(tmp_path / "new")
    assert [s.policy_seed for s in run.segments["random"]] == [4, 5, 6]
    workloads = replay_workloads(run, arrays, None)
    assert [w.policy_seed for w in workloads["random"]] == [4, 5, 6]
    _live_results(tmp_path / "old", ids, seed=None, rounds=3, policies=("random", "rr"))
    (old,) = load_live_runs(tmp_path / "old")
    assert [s.policy_seed for s in old.segments["random"]] == [0, 0, 0]  # the proxy's own
    for name in ("random", "rr"):
        path = tmp_path / "new" / f"{name}-3qps.json"
        data = orjson.loads(path.read_bytes())
        data["policy_seeds"] = data["policy_seeds"][:-1]
        path.write_bytes(orjson.dumps(data))
    with pytest.raises(EldrError, match="policy seeds"):
        load_live_runs(tmp_path / "new")


def test_a_segment_runs_its_policy_on_the_workload_seed(arrays) -> None:
    """The replayed random policy draws what the live one drew: same seed, same workers."""
    rows = np.arange(40)
    base = workload_of(arrays, np.arange(40) * 0.01, rows, np.full(40, 30), np.full(40, 4),
                       None)
    config = SimConfig(cost=COST, num_prefill=1, num_decode=4, duration_s=1.0,
                       policies=("random",), step_noise=False)

    def tpots(seed: int) -> np.ndarray:
        (result,) = simulate_segments(config, arrays, None,
                                      {"random": [replace(base, policy_seed=seed)]},
                                      top_k=SPEC.top_k).values()
        t = result.table
        return (t.latency_s - t.ttft_s) / (t.output_tokens - 1)

    assert np.array_equal(tpots(1), tpots(1))
    assert not np.array_equal(tpots(1), tpots(2))


def test_replay_rebuilds_the_prompts_of_results_without_ids(arrays, tmp_path) -> None:
    from stages.prompts import load_prompts, sample_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b"\n".join(
        orjson.dumps({"id": str(i), "prompt": f"p{i}", "domain": "d"}) for i in arrays.ids[:30]
    ))
    sample = [p.id for p in sample_prompts(load_prompts(prompts), 10, 0)]
    _live_results(tmp_path / "old", sample, with_ids=False)
    (run,) = load_live_runs(tmp_path / "old", prompts)
    assert run.segments["rr"][0].prompt_ids + run.segments["rr"][1].prompt_ids == tuple(sample)


def test_replay_errors_are_one_clear_line(arrays, tmp_path) -> None:
    with pytest.raises(EldrError, match="no results folder"):
        load_live_runs(tmp_path / "nowhere")
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "rr-3qps.json").write_bytes(orjson.dumps({"policy": "rr"}))
    with pytest.raises(EldrError, match="no live bench results"):
        load_live_runs(tmp_path / "sim")
    _live_results(tmp_path / "warm", [str(i) for i in arrays.ids[:10]], warmup=1.0)
    with pytest.raises(EldrError, match="warm-up"):
        load_live_runs(tmp_path / "warm")
    _live_results(tmp_path / "other", ["not-captured", *map(str, arrays.ids[:9])])
    (run,) = load_live_runs(tmp_path / "other")
    lacks = r"lacks 1 of the live run's 10 prompts \(e.g. 'not-captured'\)"
    with pytest.raises(EldrError, match=lacks):
        replay_workloads(run, arrays, None)


def test_validation_takes_the_live_spread_when_it_is_wider() -> None:
    experts = "distinct_experts_per_layer"
    live_a = {"rr": {"median_tpot_ms": 100.0, "p99_tpot_ms": 100.0, experts: 4.0}}
    live_b = {"rr": {"median_tpot_ms": 130.0, "p99_tpot_ms": 105.0, experts: 4.0}}
    sim = {"rr": {"median_tpot_ms": 120.0, "p99_tpot_ms": 120.0, experts: 4.3}}
    a, _ = validate([Compared("a", "a", live_a, sim), Compared("b", "b", live_b, sim)])
    checks = a.checks["rr"]
    assert checks["median_tpot_ms"].ok  # +20%, inside the runs' 26% spread
    assert checks["p99_tpot_ms"].ok is False  # +20%, past 10% (spread 5%)
    assert checks["distinct_experts_per_layer"].ok is False  # +7.5% > 5%
    assert checks["median_itl_ms"].ok is None  # shown, not judged
    assert set(a.failures()) == {("rr", "p99_tpot_ms"), ("rr", "distinct_experts_per_layer")}


def test_cli_replays_a_live_run_and_saves_the_validation(arrays, tmp_path) -> None:
    from typer.testing import CliRunner

    from eldr_cli.app import app
    from stages.signature.dataset import ModelIdentity
    from tests.conftest import write_dataset

    identity = ModelIdentity(name="syn", num_layers=2, num_experts=8, top_k=2)
    write_dataset(tmp_path / "sig.zarr", arrays, identity, rows=20)
    _live_results(tmp_path / "live", [str(i) for i in arrays.ids[:12]])
    cost = tmp_path / "cost.json"
    replace(COST, core_sharing=2).save(cost)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "bench", "--simulate", "--replay", str(tmp_path / "live"), "--data",
        str(tmp_path / "sig.zarr"), "--cost", str(cost), "--worker-cores", "0|1|1",
        "--result-dir", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert "1P2D live, 3 req/s, 12 requests per policy in 2 rounds, at most 4 in flight" in (
        result.output)
    assert "P0: core 0, D1: core 1, D2: core 1" in result.output
    assert "TPOT p50 sim/live" in result.output and "validation" in result.output
    doc = orjson.loads((out / "replay-validation.json").read_bytes())
    assert set(doc["runs"][0]["policies"]) == {"rr", "jsq"}
    assert doc["runs"][0]["policies"]["rr"]["median_tpot_ms"]["live"] == 100.0
    assert "round by round, simulated over live TPOT p50 scatters" in result.output
    assert doc["runs"][0]["round_scatter"]["rounds"] == 4  # two policies, two rounds each
    assert (out / "replay-validation.png").stat().st_size > 0
    missing = CliRunner().invoke(app, ["bench", "--replay", str(tmp_path / "live")])
    assert isinstance(missing.exception, EldrError)
    assert "add --simulate" in str(missing.exception)
    nowhere = CliRunner().invoke(app, ["bench", "--simulate", "--replay", str(tmp_path / "no"),
                                       "--data", str(tmp_path / "sig.zarr")])
    assert isinstance(nowhere.exception, EldrError)
    assert f"no results folder at {tmp_path / 'no'}" in str(nowhere.exception)


def test_a_replayed_run_finds_the_artifacts_of_its_own_home(tmp_path, monkeypatch) -> None:
    from stages.bench.replay.replay_run import store_beside

    monkeypatch.setenv("ELDR_HOME", str(tmp_path / "default-home"))
    (tmp_path / "run1" / "results").mkdir(parents=True)
    (tmp_path / "run1" / "artifacts").mkdir()
    (tmp_path / "run2" / "results").mkdir(parents=True)
    assert store_beside(tmp_path / "run1" / "results") == tmp_path / "run1" / "artifacts"
    # A results folder whose home has no store: the default one (ELDR_HOME's).
    assert store_beside(tmp_path / "run2" / "results") == tmp_path / "default-home" / "artifacts"


def test_cost_level_prices_the_live_steps_at_their_own_batch_and_experts() -> None:
    from stages.bench.replay.replay_run import cost_level

    # 12 requests of 12 tokens: 132 decode tokens over 44 steps, a batch of 3; COST's step at
    # batch 3 and 4 experts per layer is 10 + 3 + 2 x 2 x 4 = 29 ms.
    live = {"rr": {"decode_steps": 44.0, "total_output_tokens": 144.0, "completed": 12.0,
                   "distinct_experts_per_layer": 4.0, "mean_itl_ms": 29.0},
            "jsq": {"decode_steps": 44.0, "total_output_tokens": 144.0, "completed": 12.0,
                    "distinct_experts_per_layer": 4.0, "mean_itl_ms": 58.0},
            "p2c": {"mean_itl_ms": 30.0}}  # no worker counters: not priced
    assert cost_level(live, COST) == pytest.approx({"rr": 1.0, "jsq": 0.5})


def test_engine_pace_is_shown_beside_the_checks_never_judged() -> None:
    from stages.bench.replay.replay_run import engine_pace
    from stages.bench.replay.validation import format_validation, validation_json

    # jsq's live steps took twice what the model prices, the median policy's 1.25x.
    pace = engine_pace({"rr": 1.0, "p2c": 0.8, "jsq": 0.5})
    assert pace == pytest.approx({"rr": 0.8, "p2c": 1.0, "jsq": 1.6})
    live = {p: {"median_tpot_ms": 100.0, "p99_tpot_ms": 100.0, "distinct_experts_per_layer": 4.0}
            for p in pace}
    (run,) = validate([Compared("a", "a", live, live, pace)])
    assert not run.failures()
    text = format_validation([run])
    assert "live engine" in text and "+60.0%" in text and "-20.0%" in text
    assert validation_json([run])["runs"][0]["engine_pace"]["jsq"] == pytest.approx(1.6)
    (bare,) = validate([Compared("a", "a", live, live)])  # no counters: no column
    assert "live engine" not in format_validation([bare])
