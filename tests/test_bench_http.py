"""Load generator and engine-cost measurement against tiny in-process fake servers.

The fake proxy streams OpenAI SSE, switches policy through the admin API and exports eldr's
decode counters whose per-step expert count depends on the active policy, so the test can see
that every request and every counter delta is attributed to the right policy. The fake engine
runs a real step loop with a known cost model, so the fit must recover it.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from stages.bench.cost.engine_cost import EngineCostConfig, batch_prompts, measure_engine_cost
from stages.bench.live.loadgen import BenchConfig, interleaved_plan, run_policy_comparison
from stages.bench.plots import write_plots
from stages.bench.report import format_comparison
from stages.prompts import Prompt
from stages.routing.cost_model import CostModel
from stages.routing.policy_config import PolicyConfig

LAYERS = 4
EXPERTS_PER_LAYER = {"eldr": 3.0, "rr": 7.0, "jsq": 6.0}


@contextmanager
def serve(app: Starlette) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class FakeProxy:
    def __init__(self) -> None:
        self.policy = "jsq"
        self.seed = 0
        self.switches: list[str] = []
        self.switch_seeds: list[int | None] = []
        self.switch_configs: list[dict | None] = []  # the options sent with each switch
        self.served: list[tuple[str, str, str]] = []  # (request id, policy, prompt)
        self.bodies: list[dict] = []
        self.steps = 0.0
        self.active = 0.0
        self.inflight = 0
        self.max_inflight = 0
        self.app = Starlette(
            routes=[
                Route("/admin/state", self.state),
                Route("/admin/policy", self.set_policy, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/metrics", self.metrics),
            ]
        )

    async def state(self, request: Request) -> Response:
        return JSONResponse(
            {
                "policy": self.policy,
                "config": {},
                "policy_seed": self.seed,
                "artifact_version": "v1",
                "decode_workers": [{"url": str(request.base_url).rstrip("/"), "inflight": 0}],
            }
        )

    async def set_policy(self, request: Request) -> Response:
        body = await request.json()
        name = body["policy"]
        if name not in EXPERTS_PER_LAYER:
            return JSONResponse({"error": "unknown policy"}, status_code=400)
        self.policy = name
        self.seed = body.get("seed", 0)
        self.switches.append(name)
        self.switch_configs.append(body.get("config"))
        self.switch_seeds.append(body.get("seed"))
        return JSONResponse({"policy": name})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        policy, prompt = self.policy, body["prompt"]
        self.served.append((request.headers["x-request-id"], policy, prompt))
        if "FAIL" in prompt:
            return JSONResponse({"error": "boom"}, status_code=500)

        async def stream():
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            try:
                n = body["max_tokens"]
                for i in range(n):
                    await asyncio.sleep(0.003)
                    if "BREAK" in prompt and i == 2:
                        yield _sse({"error": {"message": "decode worker lost"}})
                        return
                    if i > 0:  # tokens after the first come from decode steps
                        self.steps += 1
                        self.active += EXPERTS_PER_LAYER[policy] * LAYERS
                    yield _sse({"choices": [{"index": 0, "text": f"t{i}"}], "usage": None})
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
                yield _sse({"choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"
            finally:
                self.inflight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            "# TYPE vllm:eldr_decode_steps_total counter\n"
            f'vllm:eldr_decode_steps_total{{engine="0"}} {self.steps}\n'
            f'vllm:eldr_decode_steps_created{{engine="0"}} 1700000000.0\n'
            f'vllm:eldr_decode_active_experts_total{{engine="0"}} {self.active}\n'
        )


def _prompt_file(path: Path, n: int) -> Path:
    lines = []
    for i in range(n):
        text = "FAIL" if i == 3 else "BREAK" if i == 5 else f"prompt number {i}"
        lines.append(orjson.dumps({"id": f"p{i}", "prompt": text, "domain": "d"}).decode())
    path.write_text("\n".join(lines) + "\n")
    return path


def test_interleaved_plan_rotates_and_covers() -> None:
    plan = interleaved_plan(10, ["a", "b", "c"], rounds=3, seed=5)
    assert [s.policy for s in plan] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [s.policy_seed for s in plan] == [5, 5, 5, 6, 6, 6, 7, 7, 7]
    for r in range(3):
        spans = {(s.start, s.stop) for s in plan if s.round == r}
        assert len(spans) == 1  # every policy replays the same slice
    assert sorted({(s.start, s.stop) for s in plan}) == [(0, 3), (3, 7), (7, 10)]


def test_comparison_against_fake_proxy(tmp_path: Path) -> None:
    fake = FakeProxy()
    prompts = _prompt_file(tmp_path / "prompts.jsonl", 12)
    with serve(fake.app) as url:
        config = BenchConfig(
            url=url,
            policies=("eldr", "rr"),
            prompts_path=prompts,
            num_prompts=12,
            request_rate=200.0,
            max_concurrency=3,
            seed=7,
            result_dir=tmp_path / "out",
            max_tokens=6,
            rounds=2,
            num_layers=LAYERS,
            scrape_settle_s=0.0,
            show_progress=False,
            policy_config=PolicyConfig.from_mapping({"eldr": {"tau": 0.05}}),
        )
        comparison = run_policy_comparison(config)

    # Switched per segment in rotated order, then restored to the proxy's original policy;
    # a policy's options go with every switch to it.
    assert fake.switches == ["eldr", "rr", "rr", "eldr", "jsq"]
    assert fake.switch_configs == [{"tau": 0.05}, None, None, {"tau": 0.05}, None]
    # Each round its own policy seed (the bench's seed plus the round), then the proxy's own.
    assert fake.switch_seeds == [7, 7, 8, 8, 0]
    # Every request was served under the policy it is attributed to, and each policy saw the
    # same prompts.
    by_policy: dict[str, list[str]] = {"eldr": [], "rr": []}
    for request_id, policy, prompt in fake.served:
        assert request_id.split("-")[3] == policy
        by_policy[policy].append(prompt)
    assert sorted(by_policy["eldr"]) == sorted(by_policy["rr"]) and len(by_policy["rr"]) == 12
    assert fake.max_inflight <= 3
    body = fake.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["max_tokens"] == 6

    for name, result in comparison.results.items():
        m = result.metrics
        assert m["completed"] == 10 and m["failed"] == 2  # one HTTP 500, one broken stream
        assert m["total_output_tokens"] == 60
        assert result.table.itl_s.size == 10 * 5
        assert m["median_tpot_ms"] > 2.0 and m["median_ttft_ms"] > 0
        # Counter deltas of this policy's own windows only.
        assert m["distinct_experts_per_layer"] == pytest.approx(EXPERTS_PER_LAYER[name])
        assert m["decode_steps"] == 10 * 5 + 1  # the broken stream got one decode token

    saved = orjson.loads((tmp_path / "out" / "eldr-200qps.json").read_bytes())
    assert saved["completed"] == 10 and saved["policy"] == "eldr"
    assert saved["policy_order"] == ["eldr", "rr", "rr", "eldr"]
    assert saved["policy_seeds"] == [7, 7, 8, 8]
    # As vLLM's detailed files: one entry per request in every per-request list.
    for key in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                "queue_times", "generated_texts", "errors", "prompt_ids"):
        assert len(saved[key]) == 12, key
    failed = [e for e in saved["errors"] if e]
    assert len(failed) == 2
    assert any("HTTP 500" in e for e in failed)
    assert any("decode worker lost" in e for e in failed)
    assert saved["max_concurrent_requests"] <= 3  # the bench's --max-concurrency
    assert saved["max_output_tokens_per_s"] > 0

    table = format_comparison(comparison.metrics(), "fake")
    assert "eldr" in table and "best baseline: TPOT p50 rr" in table
    paths = write_plots([comparison], tmp_path / "plots", "live, fake proxy")
    assert paths and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


# -- engine cost -------------------------------------------------------------------------
ENGINE = CostModel(num_layers=LAYERS, base_s=2e-3, per_token_s=5e-4, per_expert_s=1e-3)


class FakeEngine:
    """Continuous batching: a request's first token comes at once (prefill), then one token
    per step while it is in the batch. Each step declares its time from ENGINE with
    distinct experts/layer = 1 + 3 x (distinct domains in the batch)."""

    def __init__(self, engine: CostModel = ENGINE) -> None:
        self.engine = engine
        self.steps = 0.0
        self.active = 0.0
        self.seconds = 0.0
        self.batch: dict[int, tuple[str, asyncio.Queue, int]] = {}
        self.next_id = 0
        self.served: list[tuple[str, int]] = []  # (prompt, max_tokens), in arrival order
        self.loop_task: asyncio.Task | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/metrics", self.metrics),
            ]
        )

    async def step_loop(self) -> None:
        while self.batch:
            await asyncio.sleep(0.002)
            domains = {d for d, _, _ in self.batch.values()}
            distinct = 1.0 + 3.0 * len(domains)
            self.steps += 1
            self.active += distinct * LAYERS
            self.seconds += float(self.engine.step_time(len(self.batch), distinct))
            for rid, (domain, queue, left) in list(self.batch.items()):
                queue.put_nowait("tok")
                if left == 1:
                    del self.batch[rid]
                else:
                    self.batch[rid] = (domain, queue, left - 1)
        self.loop_task = None

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        self.served.append((prompt, n))
        domain = prompt.split()[0]
        tokens = len(prompt.split())
        queue: asyncio.Queue = asyncio.Queue()

        async def stream():
            await asyncio.sleep(0.005 + 0.0005 * tokens)  # prefill
            yield _sse({"choices": [{"text": "first"}]})
            if n > 1:
                self.next_id += 1
                self.batch[self.next_id] = (domain, queue, n - 1)
                if self.loop_task is None:
                    self.loop_task = asyncio.create_task(self.step_loop())
                for _ in range(n - 1):
                    yield _sse({"choices": [{"text": await queue.get()}]})
            yield _sse({"choices": [], "usage": {"prompt_tokens": tokens, "completion_tokens": n}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            f"eldr_decode_steps_total {self.steps}\n"
            f"eldr_decode_active_experts_total {self.active}\n"
            f"eldr_decode_step_seconds_total {self.seconds}\n"
        )


def test_batch_prompts_controls_domain_mixing() -> None:
    import numpy as np

    by_domain = {d: [Prompt(f"{d}{i}", f"{d} text", d) for i in range(5)] for d in "abcd"}
    rng = np.random.default_rng(0)
    assert len({p.domain for p in batch_prompts(by_domain, 8, 1, rng)}) == 1
    assert len({p.domain for p in batch_prompts(by_domain, 8, 2, rng)}) == 2
    assert len({p.domain for p in batch_prompts(by_domain, 8, 0, rng)}) == 4
    assert len(batch_prompts(by_domain, 12, 1, rng)) == 12  # reuses prompts past the pool


def test_engine_cost_fit_recovers_the_engine(tmp_path: Path) -> None:
    lines = []
    for d in ("alpha", "beta", "gamma", "delta"):
        for i in range(6):
            words = " ".join(["w"] * (4 + 12 * i))
            lines.append(
                orjson.dumps({"id": f"{d}{i}", "prompt": f"{d} {words}", "domain": d}).decode()
            )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    fake = FakeEngine()
    with serve(fake.app) as url:
        result = measure_engine_cost(
            EngineCostConfig(
                worker_urls=(url,),
                prompts_path=prompts,
                num_layers=LAYERS,
                batch_sizes=(1, 2, 4),
                domain_mixes=(1, 0),
                max_tokens=8,
                repeats=1,
                prefill_probes=6,
                settle_s=0.0,
            )
        )
    assert len(result.measurements) == 6
    assert all(m.step_time_source == "counter" for m in result.measurements)
    same = [m.sample.distinct for m in result.measurements if m.domains == 1]
    assert same == pytest.approx([4.0] * len(same))  # one domain: 1 + 3 experts/layer
    fit = result.model
    # The fake's steps are its counted ones; what a client sees beyond them is asyncio's.
    assert 0 <= result.step_overhead_s < 0.02
    assert fit.base_s - result.step_overhead_s == pytest.approx(ENGINE.base_s, rel=1e-3, abs=1e-6)
    assert fit.per_token_s == pytest.approx(ENGINE.per_token_s, rel=1e-3)
    assert fit.per_expert_s == pytest.approx(ENGINE.per_expert_s, rel=1e-3)
    assert result.quality["r2"] == pytest.approx(1.0)
    # Prefill from wall-clock TTFT: the slope is 0.5 ms/token plus noise of a shared machine.
    # The prefill slope comes from wall-clock timing of a fake: only its sign is reliable on
    # a loaded machine.
    assert fit.prefill_per_token_s > 0
    assert math.isfinite(fit.prefill_base_s)
    # First a warm-up prompt and a warm-up batch of the largest size (4), then the 6 timed
    # prompts (one token each) and the 14 requests of the timed batches.
    assert len(fake.served) == 1 + 4 + 6 + 14
    warm = fake.served[0][0]
    timed = [prompt for prompt, n in fake.served[5:11]]
    assert all(n == 1 for _, n in fake.served[5:11])
    assert len(set(timed)) == 6 and warm not in timed  # the probe's prompts were never cached


def test_warmup_excludes_early_requests_of_each_round(tmp_path: Path) -> None:
    from stages.bench.live.arrivals import poisson_arrivals

    fake = FakeProxy()
    lines = [
        orjson.dumps({"id": f"p{i}", "prompt": f"prompt {i}", "domain": "d"}).decode()
        for i in range(20)
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rate, warmup = 100.0, 0.05
    with serve(fake.app) as url:
        comparison = run_policy_comparison(
            BenchConfig(
                url=url,
                policies=("rr",),
                prompts_path=path,
                num_prompts=20,
                request_rate=rate,
                seed=1,
                max_tokens=3,
                rounds=2,
                warmup_s=warmup,
                scrape_settle_s=0.0,
                show_progress=False,
            )
        )
    offsets = poisson_arrivals(20, rate, seed=1)
    expected = sum(
        int(((offsets[a:b] - offsets[a]) >= warmup).sum()) for a, b in ((0, 10), (10, 20))
    )
    assert 0 < expected < 20
    assert comparison.results["rr"].metrics["completed"] == expected
    assert len(fake.served) == 20  # warm-up requests were still sent


def test_engine_cost_can_skip_the_warm_up(tmp_path: Path) -> None:
    lines = [
        orjson.dumps({"id": f"{d}{i}", "prompt": f"{d} w", "domain": d}).decode()
        for d in ("alpha", "beta") for i in range(3)
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    fake = FakeEngine()
    with serve(fake.app) as url:
        result = measure_engine_cost(EngineCostConfig(
            # 16 tokens: a batch's two requests overlap for many steps even when a loaded
            # machine starts the second late (with 4, they ran one after the other).
            worker_urls=(url,), prompts_path=prompts, num_layers=LAYERS, batch_sizes=(1, 2),
            domain_mixes=(1, 0), max_tokens=16, repeats=1, prefill_probes=0, settle_s=0.0,
            warmup=False,
        ))
    assert len(result.measurements) == 4
    assert len(fake.served) == 1 + 1 + 2 + 2  # the timed batches only, no warm-up


def test_engine_cost_measures_every_worker_at_once(tmp_path: Path) -> None:
    """A batch each, side by side, as the workers run under load; the model records how many
    shared a core."""
    lines = [
        orjson.dumps({"id": f"{d}{i}", "prompt": f"{d} {' '.join(['w'] * (4 + i))}",
                      "domain": d}).decode()
        for d in ("alpha", "beta") for i in range(4)
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    with serve(FakeEngine().app) as one, serve(FakeEngine().app) as two:
        result = measure_engine_cost(EngineCostConfig(
            worker_urls=(one, two), prompts_path=prompts, num_layers=LAYERS,
            batch_sizes=(1, 3), domain_mixes=(1, 0), max_tokens=6, repeats=1, prefill_probes=0,
            settle_s=0.0, core_sharing=(2, 2),
        ))
    assert [m.worker_url for m in result.measurements] == [one, two] * 4
    assert result.model.core_sharing == 2
    assert result.model.per_expert_s == pytest.approx(ENGINE.per_expert_s, rel=1e-3)
