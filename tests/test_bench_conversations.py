"""The live conversation bench against fake OpenAI servers: a router driven as it is (no admin
calls), turns sent with the real answers in their history, the workers' counters read as
deltas per run, and the CLI's options and refusals."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from typer.testing import CliRunner

from eldr_cli.app import app
from stages.bench.live.cache_counters import block_size_of, cache_counters
from stages.bench.live.engine_latency import (
    E2E,
    QUEUE,
    TTFT,
    EngineLatency,
    engine_latency,
    ttft_parts_ms,
)
from stages.bench.live.targets import bench_targets, parse_router, parse_variant
from stages.errors import EldrError
from stages.routing.policy_config import PolicyConfig
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker

runner = CliRunner()

METRICS_PAGE = """# HELP vllm:prefix_cache_queries Prefix cache queries.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {queries}
vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {hits}
vllm:prompt_tokens_by_source_total{{engine="0",model_name="tiny",source="local_compute"}} 5.0
vllm:prompt_tokens_by_source_total{{engine="0",model_name="tiny",source="external_kv_transfer"}} \
{pulled}
vllm:cache_config_info{{block_size="32",cache_dtype="auto",engine="0"}} 1.0
"""


def counting_worker(behavior: FakeBehavior) -> Starlette:
    """A worker's /metrics whose counters grow by 100 queries, 60 hits and 40 pulled tokens
    with each request the router served."""

    async def metrics(request: Request) -> PlainTextResponse:
        n = len(behavior.received)
        # Expert counters as eldr's plugin exports them: 3 distinct experts a decode step.
        experts = (f"eldr_decode_steps_total {10.0 * n}\n"
                   f"eldr_decode_active_experts_total {30.0 * n}\n")
        # Latency histograms: 20 ms a whole request, 5 ms to the first token, 1 ms queued.
        latency = "".join(f'{name}_{part}{{engine="0",model_name="tiny"}} {value}\n'
                          for name, seconds in ((E2E, 0.020), (TTFT, 0.005), (QUEUE, 0.001))
                          for part, value in (("sum", seconds * n), ("count", float(n))))
        return PlainTextResponse(METRICS_PAGE.format(queries=100.0 * n, hits=60.0 * n,
                                                     pulled=40.0 * n) + experts + latency)

    return Starlette(routes=[Route("/metrics", metrics)])


@pytest.fixture
def router() -> Iterator[tuple[BackgroundServer, FakeBehavior]]:
    behavior = FakeBehavior(name="router")
    with BackgroundServer(create_fake_worker(behavior)) as server:
        yield server, behavior


@pytest.fixture
def worker(router: tuple[BackgroundServer, FakeBehavior]) -> Iterator[BackgroundServer]:
    with BackgroundServer(counting_worker(router[1])) as server:
        yield server


def test_counters_are_read_by_source_and_summed_over_engines() -> None:
    page = METRICS_PAGE.format(queries=100.0, hits=64.0, pulled=50.0)
    page += 'vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 20.0\n'
    counters = cache_counters(page)
    assert (counters.queries, counters.hits, counters.external_tokens) == (120.0, 64.0, 50.0)
    assert counters.computed_tokens == 5.0 and math.isnan(counters.local_hit_tokens)
    assert block_size_of(page) == 32
    # A worker that exports none: NaN, never a perfect 0.
    assert math.isnan(cache_counters("up 1\n").hit_share)
    with pytest.raises(EldrError, match="not Prometheus text"):
        cache_counters('vllm:prefix_cache_hits_total{engine="0"} many\n')


def test_routers_are_named_and_unique() -> None:
    assert parse_router("vllm-router=http://h:1/").url == "http://h:1"
    with pytest.raises(EldrError, match="NAME=URL"):
        parse_router("http://h:1")
    with pytest.raises(EldrError, match="named twice"):
        bench_targets("http://p", ["rr"], ["rr=http://h:1"])
    targets = bench_targets("http://p", ["rr"], ["vr=http://h:1"])
    assert [(t.name, t.switches_policy) for t in targets] == [("rr", True), ("vr", False)]


def test_a_router_benches_conversations_with_their_real_answers(
    router: tuple[BackgroundServer, FakeBehavior], worker: BackgroundServer, tmp_path: Path,
) -> None:
    server, behavior = router
    result = runner.invoke(app, [
        "bench", "--workload", "conversations", "--router", f"fake={server.url}",
        "--conversations", "3", "--turns", "3", "--rounds", "2", "--think-time", "0",
        "--max-tokens", "5", "--system-tokens", "64", "--message-tokens", "32",
        "--prefill-urls", worker.url, "--decode-urls", worker.url,
        "--result-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    # No admin call: the router was driven as it is, chat completions only.
    assert {r.path for r in behavior.received} == {"/v1/chat/completions"}
    assert len(behavior.received) == 3 * 3 * 2
    # Each request names the model the router lists in /v1/models.
    assert {r.body.get("model") for r in behavior.received} == {"fake-model"}
    by_conversation: dict[str, list[list[dict[str, str]]]] = {}
    for r in behavior.received:
        conv = r.headers["x-request-id"].rsplit("-t", 1)[0]
        by_conversation.setdefault(conv, []).append(r.body["messages"])
    for turns in by_conversation.values():
        turns.sort(key=len)
        # Turn k+1 = the system prompt, turn k's messages, the answer the server gave, a new
        # message.
        for earlier, later in itertools.pairwise(turns):
            assert later[: len(earlier)] == earlier
            assert later[len(earlier)] == {"role": "assistant", "content": "t0 t1 t2 t3 t4 "}
    # Two rounds, each on its own system prompt.
    systems = {turns[0][0]["content"] for turns in by_conversation.values()}
    assert len(systems) == 2
    doc = json.loads((tmp_path / "fake-conversations.json").read_text())
    assert doc["completed"] == 18 and doc["failed"] == 0
    assert sorted(doc["turns"]) == [1] * 6 + [2] * 6 + [3] * 6
    assert doc["median_ttft_later_ms"] > 0 and doc["median_ttft_turn1_ms"] > 0
    # Two rounds: each latency's p50 has a round-to-round spread to be read against.
    assert doc["ttft_later_round_spread_ms"] >= 0 and doc["tpot_round_spread_ms"] >= 0
    assert "TPOT p50 spread" in result.output
    # Each run's counter deltas, summed over the runs: 18 requests.
    assert doc["prefill_hit_share"] == pytest.approx(0.6)
    assert doc["prefill_hit_share_by_worker"] == [pytest.approx(0.6)]
    assert doc["decode_kv_pulled_tokens"] == pytest.approx(18 * 40.0)
    # The decode workers' experts per step, over both rounds and each round's own.
    assert doc["active_experts_per_step"] == pytest.approx(3.0)
    assert doc["active_experts_per_step_by_round"] == [pytest.approx(3.0)] * 2
    assert doc["active_experts_round_spread"] == pytest.approx(0.0)
    assert doc["block_size"] == 32
    assert 0 < doc["ideal_prefill_hit_share"] <= doc["ideal_history_hit_share"] < 1
    assert "TTFT p50 t>=2" in result.output
    from stages.bench.metric_registry import CONVERSATION_METRICS

    assert [m.key for m in CONVERSATION_METRICS if m.key not in doc] == []
    assert "fake: prefill hit share per worker 0.60; requests 18; engine ms 20.00" in (
        result.output)
    assert doc["prefill_requests_by_worker"] == [18.0]
    assert doc["decode_requests_by_worker"] == [18.0]
    assert doc["decode_engine_ttft_ms_by_worker"] == [pytest.approx(5.0)]
    assert "fake: decode requests per worker 18; engine TTFT ms 5.00" in result.output
    # Where TTFT goes: the prefill engines' 20 ms, the decode engines' 5 ms, the rest outside.
    assert (doc["prefill_engine_ms"], doc["decode_engine_ttft_ms"],
            doc["decode_engine_queue_ms"]) == pytest.approx((20.0, 5.0, 1.0))
    assert doc["ttft_outside_engines_ms"] == pytest.approx(doc["mean_ttft_ms"] - 25.0)
    assert "where TTFT goes" in result.output


def test_latency_histograms_are_summed_over_engines_and_missing_ones_read_nan() -> None:
    page = (f'{E2E}_sum{{engine="0"}} 1.0\n{E2E}_count{{engine="0"}} 10.0\n'
            f'{E2E}_sum{{engine="1"}} 3.0\n{E2E}_count{{engine="1"}} 10.0\n'
            f'{E2E}_bucket{{engine="0",le="0.1"}} 4.0\n{TTFT}_sum 0.5\n{TTFT}_count 5.0\n')
    latency = engine_latency(page)
    assert latency.mean_ms("e2e") == pytest.approx(200.0)
    assert latency.mean_ms("ttft") == pytest.approx(100.0)
    assert math.isnan(latency.mean_ms("queue"))  # not exported: NaN, never 0
    later = engine_latency(page.replace(" 1.0\n", " 2.0\n").replace(" 10.0\n", " 15.0\n"))
    assert later.minus(latency).mean_ms("e2e") == pytest.approx(1e3 * 1.0 / 10)
    # A pool with no requests in a run (every turn prefilled on its decode worker): NaN.
    parts = ttft_parts_ms(30.0, EngineLatency(0.0, 0.0), latency)
    assert math.isnan(parts["prefill_engine_ms"])
    assert parts["ttft_outside_engines_ms"] == pytest.approx(30.0 - 100.0)


@pytest.mark.parametrize(("args", "message"), [
    (["--router", "x=http://h:1", "--simulate"], "not with --simulate"),
    (["some.json"], "goes with --workload sharegpt"),
    (["--workload", "sharegpt"], "needs the file"),
    (["--workload", "chats"], "unknown --workload"),
    (["--workload", "conversations", "--router", "bad"], "NAME=URL"),
    (["--workload", "conversations", "--router", "x=http://h:1", "--system-tokens", "2000"],
     "lower --system-tokens"),
])
def test_the_cli_refuses_a_bad_workload_plainly(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["bench", *args])
    # The app's entry point turns an EldrError into its message and exit status 2.
    assert isinstance(result.exception, EldrError), result.output
    assert message in str(result.exception)


def test_the_cli_passes_the_workload_options(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    import stages.bench.live.conversation_bench as conversation_bench

    seen = {}

    def fake_run(config, prefill, decode, block_size, result_dir, describe, echo):  # type: ignore[no-untyped-def]
        seen.update(config=config, prefill=prefill, decode=decode, block_size=block_size)
        return {}

    monkeypatch.setattr(conversation_bench, "run_conversation_bench", fake_run)
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                        {"from": "human",
                                                         "value": "long " * 5000}]}]))
    result = runner.invoke(app, [
        "bench", "--workload", "sharegpt", str(sharegpt), "--policies", "rr",
        "--router", "vr=http://h:9", "--turns", "4", "--think-time", "0.5",
        "--max-concurrency", "5", "--block-size", "16", "--decode-urls", "http://d:1,http://d:2",
        "--result-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert [(t.name, t.policy) for t in config.targets] == [("rr", "rr"), ("vr", None)]
    assert (config.turns, config.think_time_s, config.max_concurrency) == (4, 0.5, 5)
    assert seen["prefill"] is None and seen["decode"] == ("http://d:1", "http://d:2")
    assert seen["block_size"] == 16
    # The ShareGPT source salts every run's draw.
    first = config.source(0, "salt-a")[0]
    assert first.user_messages[0] == "hi" and first.system.startswith("Session salt-a.")
    # Messages cut to --message-tokens (128 by default), so none outgrows the model alone.
    assert len(config.tokenizer.encode(first.user_messages[1])) <= 128


def test_the_cli_simulates_the_conversation_workload(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    import stages.bench.sim.conversation_sim_run as conversation_sim_run

    seen = []
    monkeypatch.setattr(conversation_sim_run, "run_conversation_sim",
                        lambda options, echo: seen.append(options))
    monkeypatch.setenv("ELDR_HOME", str(tmp_path))
    result = runner.invoke(app, [
        "bench", "--simulate", "--workload", "conversations", "--request-rate", "3",
        "--turns", "4", "--think-time", "2", "--cache-blocks", "1000", "--prefill", "2",
        "--decode", "4", "--output-tokens", "100"])
    assert result.exit_code == 0, result.output
    (options,) = seen
    assert options.policies[0] == "eldr-kv" and (options.prefill, options.decode) == (2, 4)
    w = options.workload
    assert (w.conversation_rate, w.turns, w.think_time_s, w.output_tokens) == (3.0, 4, 2.0, 100)
    assert w.conversations == 600  # a cluster's worth, not the live bench's 12
    assert options.cache_blocks == 1000 and options.cost == "gpu"
    bad = runner.invoke(app, ["bench", "--simulate", "--workload", "conversations",
                              "--request-rate", "50%"])
    assert isinstance(bad.exception, EldrError) and "conversations a second" in str(bad.exception)


def test_single_turn_bench_drives_a_router_as_it_is(
    router: tuple[BackgroundServer, FakeBehavior], tmp_path: Path
) -> None:
    """`eldr bench --router NAME=URL` without an eldr proxy: completions to the router only,
    no admin call, its row in the table and its results file."""
    server, behavior = router
    result = runner.invoke(app, [
        "bench", "--router", f"fake={server.url}", "--num-prompts", "4", "--rounds", "2",
        "--request-rate", "inf", "--max-tokens", "3", "--result-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert {r.path for r in behavior.received} == {"/v1/completions"}
    assert len(behavior.received) == 4
    doc = json.loads((tmp_path / "fake-infqps.json").read_text())
    assert doc["completed"] == 4 and doc["failed"] == 0
    assert doc["routers"] == {"fake": server.url} and doc["policy_order"] == ["fake", "fake"]
    assert "\nfake " in result.output


def test_a_variant_is_a_row_of_its_own_with_exactly_its_options() -> None:
    """Two configurations of one policy in one run: every row of that policy sends the
    policy's defaults for what any variant of it sets (the proxy keeps a policy's options
    across switches), under --policy-config's, under the variant's own."""
    config = PolicyConfig.from_mapping({"eldr-kv": {"load_slack": 2.0}})
    variants = [parse_variant('arrival=eldr-kv:{"decode_choice": "arrival"}'),
                parse_variant('local=eldr-kv:{"local_prefill_below": 256}')]
    targets = bench_targets("http://p/", ["eldr-kv", "jsq"], ["vr=http://h:1"], variants, config)
    rows = {t.name: (t.url, t.policy, None if t.options is None else dict(t.options))
            for t in targets}
    after_prefill = {"decode_choice": "after-prefill", "local_prefill_below": 0,
                     "load_slack": 2.0}
    assert rows == {
        "eldr-kv": ("http://p", "eldr-kv", after_prefill),
        "jsq": ("http://p", "jsq", None),  # no variant of it: --policy-config's, as before
        "arrival": ("http://p", "eldr-kv", {**after_prefill, "decode_choice": "arrival"}),
        "local": ("http://p", "eldr-kv", {**after_prefill, "local_prefill_below": 256}),
        "vr": ("http://h:1", None, None),
    }
    with pytest.raises(EldrError, match="named twice"):
        bench_targets("http://p", ["eldr-kv"], [], [parse_variant("eldr-kv=eldr-kv:{}")])


@pytest.mark.parametrize(("text", "message"), [
    ("arrival", "LABEL=POLICY:JSON"),
    ("arrival=eldr-kv", "LABEL=POLICY:JSON"),
    ("arrival=nope:{}", "unknown policy 'nope'"),
    ("arrival=eldr-kv:{decode", "not JSON"),
    ("arrival=eldr-kv:[1]", "must be a JSON object"),
    ('arrival=eldr-kv:{"decode_choice": "never"}', "decode_choice must be one of"),
])
def test_a_bad_variant_is_refused_plainly(text: str, message: str) -> None:
    with pytest.raises(EldrError, match=message):
        parse_variant(text)


def test_the_cli_benches_variants_on_the_conversation_workload(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import stages.bench.live.conversation_bench as conversation_bench

    seen = []
    monkeypatch.setattr(conversation_bench, "run_conversation_bench",
                        lambda config, *args: seen.append(config) or {})
    monkeypatch.setenv("ELDR_HOME", str(tmp_path))
    result = runner.invoke(app, [
        "bench", "--workload", "conversations", "--variant",
        'arrival=eldr-kv:{"decode_choice": "arrival"}', "--variant", "plain=eldr-kv:{}",
        "--policy-config", '{"eldr-kv": {"local_prefill_below": 64}}'])
    assert result.exit_code == 0, result.output
    (config,) = seen
    # No --policies: the variants alone, not every policy.
    assert [(t.name, t.policy, dict(t.options or ())) for t in config.targets] == [
        ("arrival", "eldr-kv", {"decode_choice": "arrival", "local_prefill_below": 64}),
        ("plain", "eldr-kv", {"decode_choice": "after-prefill", "local_prefill_below": 64}),
    ]
    refused = runner.invoke(app, ["bench", "--variant", "a=rr:{}"])
    assert isinstance(refused.exception, EldrError) and "add --workload" in str(
        refused.exception)
