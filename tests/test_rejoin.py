"""Workers rejoin rotation only after passing the self-check again (stages.serve.proxy.ops.rejoin).

Prober-level tests drive the health probes round by round against fake workers; one test runs
the whole proxy to see the reason in /admin/state and /metrics; the last ones cover the
opt-out (--skip-self-check) and what it forbids.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from starlette.testclient import TestClient

from stages.errors import EldrError
from stages.serve.proxy import create_app
from stages.serve.proxy.client.http1 import Http1Client
from stages.serve.proxy.client.upstream import leg_limits
from stages.serve.proxy.config import ProxyConfig
from stages.serve.proxy.ops.health import Prober
from stages.serve.proxy.ops.rejoin import RestartCounts, SelfChecks, no_restarts
from stages.serve.proxy.ops.self_check import PROBE_PROMPT
from stages.serve.proxy.view.workers import WorkerPool
from stages.signature import wire
from stages.signature.dataset import ModelIdentity
from tests.fakes.worker import (
    SIGNATURE_SHAPE,
    BackgroundServer,
    FakeBehavior,
    create_fake_worker,
    domain_signature,
)

IDENTITY = ModelIdentity("fake", *SIGNATURE_SHAPE, top_k=2)


@pytest.fixture
def fakes() -> Iterator[list[tuple[FakeBehavior, str]]]:
    behaviors = [FakeBehavior("d0"), FakeBehavior("d1")]
    with BackgroundServer(create_fake_worker(behaviors[0]), "critical") as s0, \
            BackgroundServer(create_fake_worker(behaviors[1]), "critical") as s1:
        yield [(behaviors[0], s0.url), (behaviors[1], s1.url)]


def checks_sent(behavior: FakeBehavior) -> int:
    return sum(r.body.get("prompt") == PROBE_PROMPT for r in behavior.received)


def no_signature(body: dict[str, Any]) -> np.ndarray | None:
    return None


Check = Callable[[Prober, SelfChecks, WorkerPool], Awaitable[None]]


def _run(urls: list[str], check: Check, *, verified: bool = True,
         restarts: RestartCounts = no_restarts) -> None:
    pool = WorkerPool(urls, "decode")

    async def main() -> None:
        async with Http1Client(16, 4.0) as client:
            checks = SelfChecks(IDENTITY, "fake-model", leg_limits(0.5, 0.3), [pool], restarts,
                                verified_at_start=verified)
            try:
                await check(Prober(client, leg_limits(0.3, 0.3), checks=checks), checks, pool)
            finally:
                await checks.close()

    asyncio.run(main())


async def probe(prober: Prober, checks: SelfChecks, pool: WorkerPool) -> None:
    """One probe round, then whatever self-checks it started, to their end."""
    await prober.probe_all([pool])
    tasks = [checks.record(pool.role, i).task for i in range(len(pool))]
    await asyncio.gather(*(t for t in tasks if t is not None), return_exceptions=True)


def test_a_worker_back_without_signatures_stays_out_then_rejoins_once_it_records(
    fakes: list[tuple[FakeBehavior, str]], caplog: pytest.LogCaptureFixture
) -> None:
    (behavior, url), _ = fakes
    caplog.set_level(logging.WARNING, "stages.serve")

    async def check(prober: Prober, checks: SelfChecks, pool: WorkerPool) -> None:
        for _ in range(3):
            await probe(prober, checks, pool)
        assert pool.healthy(0) and checks_sent(behavior) == 0  # verified: never asked again
        behavior.healthy = False  # down (a restart under way)...
        await probe(prober, checks, pool)
        assert not pool.healthy(0)
        behavior.healthy, behavior.signature = True, no_signature  # ...back without eldr
        for _ in range(3):
            await probe(prober, checks, pool)
        assert not pool.healthy(0)
        assert (pool.views()[0].last_error or "").startswith(
            f"self-check: worker {url} returns no expert signature"
        )
        record = checks.record("decode", 0)
        assert (record.verified, record.passed, record.failed) == (False, 1, 3)
        assert checks_sent(behavior) == 3  # retried at each probe
        assert caplog.text.count("stays out of rotation") == 1  # one warning per episode
        behavior.signature = domain_signature  # recording again
        await probe(prober, checks, pool)
        assert pool.healthy(0)
        assert (record.verified, record.passed, record.failed) == (True, 2, 3)
        await probe(prober, checks, pool)
        assert checks_sent(behavior) == 4

    _run([url], check)


@pytest.mark.parametrize(
    "breakage",
    [
        {"self_check_reply": b"not json at all"},
        {"self_check_reply": b'{"choices": []}'},
        {"self_check_reply": b'["a", "list"]'},
        {"self_check_reply": orjson.dumps({"kv_transfer_params": {
            wire.SIGNATURE_KEY: "!!", wire.SHAPE_KEY: [4, 16]}})},
        {"signature": lambda body: np.ones((3, 16), np.int32)},  # another model's shape
        {"signature": lambda body: np.zeros(SIGNATURE_SHAPE, np.int32)},  # hook missing
        {"fail_status": 500},
        {"delay_s": 1.5},  # no answer within the check's timeout
    ],
)
def test_garbage_answers_keep_a_worker_out_and_the_prober_running(
    fakes: list[tuple[FakeBehavior, str]], breakage: dict[str, Any]
) -> None:
    (broken, url), (_, other) = fakes
    for name, value in breakage.items():
        setattr(broken, name, value)

    async def check(prober: Prober, checks: SelfChecks, pool: WorkerPool) -> None:
        pool.mark_unhealthy(0, "stream broke")  # out: it must prove itself to rejoin
        # Two checks, each started by a probe round whose /health answered in time: on a
        # loaded machine a round's 0.3 s health probe may time out and start none.
        for _ in range(10):
            if checks.record("decode", 0).failed >= 2:
                break
            await probe(prober, checks, pool)
        assert not pool.healthy(0) and pool.healthy(1)
        assert (pool.views()[0].last_error or "").startswith("self-check: ")
        assert checks.record("decode", 0).failed == 2
        broken.reset()
        await probe(prober, checks, pool)
        assert pool.healthy(0)

    _run([url, other], check)


def test_unverified_workers_are_checked_in_rotation_and_a_failing_one_leaves(
    fakes: list[tuple[FakeBehavior, str]], caplog: pytest.LogCaptureFixture
) -> None:
    (good, good_url), (bad, bad_url) = fakes
    bad.signature = no_signature
    caplog.set_level(logging.WARNING, "stages.serve")

    async def check(prober: Prober, checks: SelfChecks, pool: WorkerPool) -> None:
        await probe(prober, checks, pool)
        assert pool.healthy(0) and not pool.healthy(1)
        assert checks.record("decode", 0).passed == 1
        assert caplog.text.count("returns no expert signature") == 1  # the pool's own warning
        await probe(prober, checks, pool)
        assert checks_sent(good) == 1 and checks_sent(bad) == 2

    _run([good_url, bad_url], check, verified=False)


def test_a_restart_the_probes_missed_is_checked_again(
    fakes: list[tuple[FakeBehavior, str]],
) -> None:
    (behavior, url), _ = fakes
    restarts = {url: 0}

    async def check(prober: Prober, checks: SelfChecks, pool: WorkerPool) -> None:
        await probe(prober, checks, pool)
        assert checks_sent(behavior) == 0
        restarts[url] = 1  # restarted between two probes: never seen down
        behavior.signature = no_signature
        await probe(prober, checks, pool)
        assert not pool.healthy(0) and checks_sent(behavior) == 1
        behavior.signature = domain_signature
        await probe(prober, checks, pool)
        await probe(prober, checks, pool)
        assert pool.healthy(0) and checks_sent(behavior) == 2

    _run([url], check, restarts=lambda u: restarts.get(u, 0))


def test_a_worker_that_goes_down_during_its_check_does_not_rejoin(
    fakes: list[tuple[FakeBehavior, str]],
) -> None:
    (behavior, url), _ = fakes

    async def check(prober: Prober, checks: SelfChecks, pool: WorkerPool) -> None:
        pool.mark_unhealthy(0, "stream broke")
        behavior.delay_s = 0.3
        await prober.probe_all([pool])  # the check starts, and waits for its answer
        behavior.healthy = False
        await prober.probe_all([pool])  # seen down meanwhile: that check no longer counts
        await asyncio.sleep(0.5)
        assert not pool.healthy(0)
        assert checks.record("decode", 0).passed == 1  # only the start-up one

    _run([url], check)


# --- the whole proxy: the reason in /admin/state and /metrics ---


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.02)


def test_the_proxy_shows_why_a_worker_stays_out_and_routes_around_it(
    fakes: list[tuple[FakeBehavior, str]],
) -> None:
    (d0, d0_url), (d1, d1_url) = fakes
    prefill = FakeBehavior("p0")
    with BackgroundServer(create_fake_worker(prefill), "critical") as p0:
        config = ProxyConfig(
            prefill_urls=(p0.url,), decode_urls=(d0_url, d1_url), policy="eldr-union",
            model="fake-model", model_top_k=2, self_check=IDENTITY, checked_at_start=True,
            health_interval_s=0.05, health_timeout_s=0.5, self_check_timeout_s=1.0,
        )
        with BackgroundServer(create_app(config), "critical") as proxy, \
                httpx.Client(base_url=proxy.url, timeout=10) as client:
            def worker(role: str, index: int) -> dict[str, Any]:
                return client.get("/admin/state").json()[f"{role}_workers"][index]  # type: ignore[no-any-return]

            def metric(name: str, worker: str) -> str:
                line = f'{name}{{role="decode",worker="{worker}"}} '
                text = client.get("/metrics").text
                return next(x for x in text.splitlines() if x.startswith(line)).split()[-1]

            assert client.get("/admin/state").json()["self_check"] == "on"
            assert worker("decode", 0)["self_check"] == {"verified": True, "passed": 1,
                                                         "failed": 0}
            d0.healthy = False
            _wait(lambda: not worker("decode", 0)["healthy"], 3, "d0 out")
            d0.healthy, d0.signature = True, no_signature
            _wait(lambda: worker("decode", 0)["self_check"]["failed"] >= 2, 5, "d0 checked")
            state = worker("decode", 0)
            assert not state["healthy"]
            assert state["last_error"].startswith(f"self-check: worker {d0_url} returns no")
            assert float(metric("eldr_worker_self_check_failures_total", "decode-0")) >= 2
            assert metric("eldr_router_worker_healthy", "decode-0") == "0.0"
            for i in range(4):
                r = client.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 2})
                assert r.status_code == 200, r.text
            assert all(r.body.get("prompt") == PROBE_PROMPT for r in d0.received)
            d0.signature = domain_signature
            _wait(lambda: worker("decode", 0)["healthy"], 3, "d0 back")
            assert worker("decode", 0)["self_check"]["passed"] == 2
            assert metric("eldr_worker_self_check_passes_total", "decode-0") == "2.0"
            assert metric("eldr_worker_self_check_passes_total", "decode-1") == "1.0"
            assert checks_sent(d1) == 0  # never left: never asked again


# --- the opt-out: plain vLLM workers behind a load balancer ---


def test_without_the_check_no_policy_that_reads_signatures_may_run() -> None:
    urls = {"prefill_urls": ("http://127.0.0.1:1",), "decode_urls": ("http://127.0.0.1:2",)}
    with pytest.raises(EldrError, match="policy 'eldr-union' reads expert signatures"):
        ProxyConfig(**urls, policy="eldr-union", skip_self_check=True)
    app = create_app(ProxyConfig(**urls, policy="rr", skip_self_check=True))
    with TestClient(app) as client:
        state = client.get("/admin/state").json()
        assert state["self_check"] == "skipped"
        assert state["decode_workers"][0]["self_check"] is None
        for name in ("eldr-union", "eldr", "eldr-bl"):
            r = client.post("/admin/policy", json={"policy": name})
            assert r.status_code == 409, r.text
            error = r.json()["error"]
            assert error["param"] == "policy"
            assert "were not self-checked (--skip-self-check)" in error["message"]
            assert "use a policy that reads none (kv, rr, jsq, random, p2c)" in error["message"]
        assert client.get("/admin/state").json()["policy"] == "rr"  # nothing changed
        assert client.post("/admin/policy", json={"policy": "jsq"}).status_code == 200
        assert "eldr_worker_self_check" not in client.get("/metrics").text


def test_a_worker_back_under_another_model_name_stays_out_naming_both(
    fakes: list[tuple[FakeBehavior, str]],
) -> None:
    """A worker restarted by hand under another --served-model-name: the proxy forwards under
    the name the others serve, so it stays out, with both names, until it serves that one."""
    (behavior, url), _ = fakes

    async def check(prober: Prober, checks: SelfChecks, pool: WorkerPool) -> None:
        behavior.healthy = False
        await probe(prober, checks, pool)
        behavior.healthy, behavior.served_name = True, "/models/other"
        await probe(prober, checks, pool)
        assert not pool.healthy(0)
        reason = pool.views()[0].last_error or ""
        assert "'/models/other'" in reason and "'fake-model'" in reason and url in reason
        behavior.served_name = "fake-model"
        await probe(prober, checks, pool)
        assert pool.healthy(0)

    _run([url], check)
