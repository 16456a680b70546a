"""Supervision: ended workers restart with backoff, and the proxy sees them leave and rejoin.

The backoff logic runs against fake workers and a fake clock; the end-to-end test runs fake
workers as real processes under keepers, kills one with SIGKILL, and watches the proxy.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from stages.procs import keeper, linux
from stages.serve.cluster.supervisor import Backoff, Supervisor
from tests.conftest import free_port
from tests.fakes.worker import BackgroundServer


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeWorker:
    url: str
    started_at: float
    log_path: Path = Path("/logs/worker.log")
    code: int | None = None
    dead: bool = False

    def exit_code(self) -> int | None:
        return self.code

    def engine_dead(self) -> bool:
        return self.dead


@dataclass
class FakeWorkers:
    clock: Clock
    servers: list[FakeWorker] = field(default_factory=list)
    restarted: list[tuple[int, float]] = field(default_factory=list)
    fail_next: int = 0  # restarts that raise OSError (no process could be started)

    def restart(self, index: int) -> FakeWorker:
        if self.fail_next:
            self.fail_next -= 1
            raise OSError(12, "Cannot allocate memory")
        self.restarted.append((index, self.clock.now))
        self.servers[index] = FakeWorker(self.servers[index].url, self.clock.now)
        return self.servers[index]


def _delay_to_restart(supervisor: Supervisor, workers: FakeWorkers, clock: Clock) -> float:
    """Seconds from the check that finds the worker ended to its restart (0.25 s steps)."""
    found, count = clock.now, len(workers.restarted)
    supervisor.check()
    while len(workers.restarted) == count:
        clock.now += 0.25
        supervisor.check()
    return clock.now - found


def test_a_crash_loop_backs_off_and_a_stable_worker_restarts_fast(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    workers = FakeWorkers(clock, [FakeWorker("http://w0", 0.0), FakeWorker("http://w1", 0.0)])
    supervisor = Supervisor(workers, Backoff(first_s=1.0, max_s=4.0, stable_s=100.0),
                            clock=clock)
    caplog.set_level(logging.WARNING, "stages.serve.cluster.supervisor")
    clock.now = 10.0
    workers.servers[0].code = -9
    assert _delay_to_restart(supervisor, workers, clock) == 1.0
    assert "worker http://w0 exited with code -9 after 10 s up; restarting in 1 s" in caplog.text
    # Crashes soon after each start: the delay doubles up to its cap.
    delays = []
    for _ in range(3):
        clock.now += 5.0
        workers.servers[0].code = 1
        delays.append(_delay_to_restart(supervisor, workers, clock))
    assert delays == [2.0, 4.0, 4.0]
    # Ran longer than stable_s before ending: back to the first delay.
    clock.now += 150.0
    workers.servers[0].code = 0
    assert _delay_to_restart(supervisor, workers, clock) == 1.0
    assert [i for i, _ in workers.restarted] == [0] * 5
    assert supervisor.restarts("http://w0") == 5
    assert supervisor.restarts("http://w1") == 0  # never ended, never touched
    assert supervisor.restarts("http://elsewhere") == 0


def test_a_restart_that_cannot_start_a_process_is_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    workers = FakeWorkers(clock, [FakeWorker("http://w0", 0.0)], fail_next=1)
    supervisor = Supervisor(workers, Backoff(first_s=1.0, stable_s=100.0), clock=clock)
    workers.servers[0].code = 1
    # The first try (1 s after) fails; the next waits 2 s, as after a second crash.
    assert _delay_to_restart(supervisor, workers, clock) == 3.0
    assert "restarting worker http://w0 failed" in caplog.text
    assert supervisor.restarts("http://w0") == 1


def test_a_worker_whose_engine_died_is_restarted_once_it_keeps_saying_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    workers = FakeWorkers(clock, [FakeWorker("http://w0", 0.0)])
    supervisor = Supervisor(workers, Backoff(first_s=1.0, dead_engine_s=3.0), clock=clock)
    workers.servers[0].dead = True
    clock.now = 1.0
    supervisor.check()
    workers.servers[0].dead = False  # one 503 (a shutdown under way, say) is not enough
    clock.now = 5.0
    supervisor.check()
    workers.servers[0].dead = True
    for now in (6.0, 8.0, 8.75):
        clock.now = now
        supervisor.check()
    assert workers.restarted == []
    # 3 s of "engine died", then the usual first delay.
    assert _delay_to_restart(supervisor, workers, clock) == 1.25
    assert "has answered /health 503 (its engine died) for 3 s" in caplog.text
    assert workers.restarted == [(0, 10.0)]


def test_backoff_doubles_up_to_its_cap() -> None:
    backoff = Backoff(first_s=0.5, max_s=10.0)
    assert [backoff.delay(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


# --- end to end: fake workers in processes, a real proxy, a real supervisor ---


class WorkerProcess:
    """A fake worker process under a keeper, as VllmServer runs a vLLM server."""

    def __init__(self, port: int, name: str, log_dir: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.port, self.name = port, name
        self.log_path = log_dir / f"{name}.log"
        self.started_at = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = keeper.spawn(
                [sys.executable, "-m", "tests.fakes.worker_process", str(port), name],
                dict(os.environ), log,
            )

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def engine_dead(self) -> bool:
        return False  # a fake worker has no engine to lose; killing its process is the test

    def worker_pid(self) -> int:
        """The fake worker itself (the keeper's child), the process a crash would end."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            children = linux.descendants(self.proc.pid)
            if children:
                return children[0].pid
            time.sleep(0.05)
        raise AssertionError("the keeper started no worker")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone with its whole group
        self.proc.wait()


class ProcessWorkers:
    def __init__(self, names: list[str], log_dir: Path) -> None:
        self.log_dir = log_dir
        self.servers = [WorkerProcess(free_port(), n, log_dir) for n in names]

    def restart(self, index: int) -> WorkerProcess:
        old = self.servers[index]
        old.stop()
        self.servers[index] = WorkerProcess(old.port, old.name, self.log_dir)
        return self.servers[index]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[ProcessWorkers]:
    workers = ProcessWorkers(["p0", "d0", "d1"], tmp_path)
    try:
        yield workers
    finally:
        workers.stop()


def _wait(cond, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_killed_worker_leaves_routing_is_restarted_and_rejoins(
    workers: ProcessWorkers,
) -> None:
    from stages.serve.proxy import create_app
    from stages.serve.proxy.config import ProxyConfig
    from stages.signature.dataset import ModelIdentity
    from tests.fakes.worker import SIGNATURE_SHAPE

    p0, d0, d1 = workers.servers
    # Workers rejoin after a self-check, as under eldr serve (the fakes are still starting, so
    # the proxy's first check of each counts as their start-up one).
    config = ProxyConfig(prefill_urls=(p0.url,), decode_urls=(d0.url, d1.url), policy="rr",
                         health_interval_s=0.2, health_timeout_s=1.0,
                         self_check=ModelIdentity("fake", *SIGNATURE_SHAPE, top_k=2))
    supervisor = Supervisor(workers, Backoff(first_s=0.2), poll_s=0.1)
    app = create_app(config, restarts=supervisor.restarts)
    with BackgroundServer(app) as proxy, httpx.Client(base_url=proxy.url, timeout=10) as client:
        def health() -> dict:  # type: ignore[type-arg]
            return client.get("/health").json()  # type: ignore[no-any-return]

        full = {"status": "ok", "prefill_healthy": 1, "decode_healthy": 2, "unheard_streams": []}
        _wait(lambda: health() == full, 20, "fake workers up")
        supervisor.start()
        try:
            for victim, key in ((d0, "decode_healthy"), (p0, "prefill_healthy")):
                index = workers.servers.index(victim)
                before = full[key]
                os.kill(victim.worker_pid(), signal.SIGKILL)
                # Out of routing within a probe interval or two, with no request to notice.
                _wait(lambda k=key, b=before: health()[k] == b - 1, 3, f"{victim.name} out")
                _wait(lambda k=key, b=before: health()[k] == b, 20, f"{victim.name} back")
                assert workers.servers[index] is not victim
                assert supervisor.restarts(victim.url) == 1
                for i in range(4):
                    r = client.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 2})
                    assert r.status_code == 200, r.text
        finally:
            supervisor.stop()
        state = client.get("/admin/state").json()
        assert [w["restarts"] for w in state["decode_workers"]] == [1, 0]
        assert [w["restarts"] for w in state["prefill_workers"]] == [1]
        metrics = client.get("/metrics").text
        assert 'eldr_worker_restarts_total{worker="decode-0"} 1.0' in metrics
        assert 'eldr_worker_restarts_total{worker="decode-1"} 0.0' in metrics
        assert 'eldr_worker_restarts_total{worker="prefill-0"} 1.0' in metrics
        # Each restarted worker passed the self-check again before it rejoined.
        for role, worker, passes in (("decode", "decode-0", 2), ("decode", "decode-1", 1),
                                     ("prefill", "prefill-0", 2)):
            line = f'eldr_worker_self_check_passes_total{{role="{role}",worker="{worker}"}}'
            assert f"{line} {passes}.0" in metrics


def test_keeper_reports_a_killed_worker_as_its_own_exit(workers: ProcessWorkers) -> None:
    victim = workers.servers[1]
    os.kill(victim.worker_pid(), signal.SIGKILL)
    _wait(lambda: victim.exit_code() is not None, 5, "keeper exit")
    assert victim.exit_code() == 128 + signal.SIGKILL
