"""Several proxies in front of the same workers (``eldr serve --proxy-workers N``, ``--peer``):
one port for all, admin changes that reach every one, one /metrics with all of them, a stop
that drains all, and no process left behind when the first one is killed."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from stages.procs import linux
from stages.procs.health import wait_healthy
from stages.serve.proxy import create_app
from stages.serve.proxy.front.peers import merge_metrics
from tests.conftest import free_port
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker
from tests.test_proxy import fast_config


@pytest.fixture
def workers() -> Iterator[list[BackgroundServer]]:
    servers = [BackgroundServer(create_fake_worker(FakeBehavior(n)), "critical").start()
               for n in ("p0", "d0", "d1")]
    yield servers
    for s in servers:
        s.stop()


def _group(workers: list[BackgroundServer], port: int, processes: int,
           drain_s: float = 5.0, extra: str = "") -> subprocess.Popen[str]:
    """``extra``: more ProxyConfig fields. The group prints READY when it calls on_ready."""
    config = (f"ProxyConfig(prefill_urls=({workers[0].url!r},),"
              f" decode_urls=({workers[1].url!r}, {workers[2].url!r}), policy='jsq',"
              f" health_interval_s=0.2{extra})")
    code = ("from stages.serve.proxy.config import ProxyConfig\n"
            "from stages.serve.proxy.group import serve_group\n"
            f"serve_group({config}, '127.0.0.1', {port}, {processes}, log_level='warning',"
            f" drain_timeout_s={drain_s}, on_ready=lambda: print('READY', flush=True))\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_the_group_says_ready_once_every_process_heard_its_workers_streams(
        workers: list[BackgroundServer]) -> None:
    # The decode workers' batch streams at addresses nobody publishes on: each process stays
    # "warming" for the streams' silence bound, then turns ready naming them.
    silent = ", ".join(f"'tcp://127.0.0.1:{free_port()}'" for _ in range(2))
    port = free_port()
    started = time.monotonic()
    proc = _group(workers, port, 2, extra=f", decode_batch_endpoints=({silent}),"
                  " batch_stale_after_s=3.0")
    try:
        assert proc.stdout is not None
        said, _, _ = select.select([proc.stdout], [], [], 60)
        assert said, "the group never said it was ready"
        assert proc.stdout.readline().strip() == "READY"
        assert time.monotonic() - started >= 3.0  # not before the bound
        for _ in range(10):  # new connections: the kernel spreads them over both processes
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
            assert health["status"] == "ok"
            assert len(health["unheard_streams"]) == 2
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert "READY" not in out  # once


def _alive(pid: int) -> bool:
    info = linux.read_info(pid)
    return info is not None and not info.zombie


def _wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _children(pid: int, count: int) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # The spawned processes, not multiprocessing's resource tracker.
        found = [p.pid for p in linux.descendants(pid)
                 if "multiprocessing.spawn" in _cmdline(p.pid)]
        if len(found) >= count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{count} proxy processes did not start")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_two_processes_share_the_port_the_admin_changes_and_the_metrics(
        workers: list[BackgroundServer]) -> None:
    port = free_port()
    proc = _group(workers, port, 2)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60, proc.poll, interval_s=0.1)
        [child] = _children(proc.pid, 1)
        names = set()
        for i in range(40):  # a new connection each: the kernel spreads them over both
            with httpx.Client(base_url=url, timeout=10) as client:
                r = client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 3})
                assert r.status_code == 200, r.text
                names.add(client.get("/admin/state").json()["proxy"])
        assert len(names) == 2, names

        with httpx.Client(base_url=url, timeout=10) as client:
            state = client.get("/admin/state").json()
            [peer] = state["peers"]
            switched = client.post("/admin/policy", json={"policy": "rr"})
            assert switched.status_code == 200, switched.text
            assert switched.json()["peers_told"] == [{"peer": peer, "status": 200}]
            assert httpx.get(peer + "/admin/state").json()["policy"] == "rr"
            drained = client.post("/admin/workers/decode-1/drain").json()
            assert drained["peers_told"][0]["status"] == 200
            peer_decode = httpx.get(peer + "/admin/state").json()["decode_workers"]
            assert [w["draining"] for w in peer_decode] == [False, True]
            # A bad change is refused where it was sent and reaches no peer.
            bad = client.post("/admin/policy", json={"policy": "no-such"})
            assert bad.status_code == 400 and "peers_told" not in bad.json()
            assert httpx.get(peer + "/admin/state").json()["policy"] == "rr"

            metrics = client.get("/metrics").text
        decisions = [line for line in metrics.splitlines()
                     if line.startswith("eldr_router_decisions_total{")]
        proxies = {line.split('proxy="')[1].split('"')[0] for line in decisions}
        assert proxies == names  # both processes routed, each labelled by its name
        assert metrics.count("# TYPE eldr_router_decisions_total counter") == 1

        proc.send_signal(signal.SIGTERM)  # drains and stops every process
        assert proc.wait(timeout=30) is not None
        assert _wait_gone([child], 10)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _names_seen(url: str, count: int, timeout_s: float = 60) -> set[str]:
    """The proxies answering at ``url`` once ``count`` of them did (each new connection may
    reach any of them)."""
    names: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(names) < count and time.monotonic() < deadline:
        with httpx.Client(base_url=url, timeout=10) as client:
            names.add(client.get("/admin/state").json()["proxy"])
    assert len(names) == count, names
    return names


def test_a_killed_first_process_takes_the_others_with_it(
        workers: list[BackgroundServer]) -> None:
    port = free_port()
    proc = _group(workers, port, 3)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 60, proc.poll, interval_s=0.1)
        children = _children(proc.pid, 2)
        _names_seen(url, 3)  # every process serving
        proc.kill()
        proc.wait()
        assert _wait_gone(children, 10), [p for p in children if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _children_left(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_first_process_killed_while_the_others_start_leaves_none(
        workers: list[BackgroundServer]) -> None:
    """Killed before the others could ask the kernel to follow it: they see it gone and end."""
    proc = _group(workers, free_port(), 3)
    try:
        children = _children(proc.pid, 2)  # spawned, most likely still importing
        proc.kill()
        proc.wait()
        assert _wait_gone(children, 30), [p for p in children if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def _children_left(pid: int) -> list[int]:
    return [p.pid for p in linux.descendants(pid)]


def test_a_peer_that_cannot_be_reached_is_reported_and_the_change_still_applies(
        workers: list[BackgroundServer]) -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    config = fast_config([workers[0].url], [w.url for w in workers[1:]], policy="jsq",
                         peers=(gone,))
    with BackgroundServer(create_app(config)) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=20) as client:
        r = client.post("/admin/policy", json={"policy": "rr"})
        assert r.status_code == 200
        [told] = r.json()["peers_told"]
        assert told["peer"] == gone and "status" not in told and "Connect" in told["error"]
        assert client.get("/admin/state").json()["policy"] == "rr"
        # Its own series are still served, labelled.
        assert 'proxy="0"' in client.get("/metrics").text


def test_merged_metrics_name_each_family_once_with_every_proxys_series() -> None:
    one = (b'# HELP x_total Things.\n# TYPE x_total counter\nx_total{worker="a"} 1.0\n'
           b'# HELP g A gauge.\n# TYPE g gauge\ng 2.0\n')
    two = b'# HELP x_total Things.\n# TYPE x_total counter\nx_total{worker="a"} 5.0\n'
    text = merge_metrics({"p0": one, "p1": two}).decode()
    assert text.count("# TYPE x_total counter") == 1
    assert 'x_total{proxy="p0",worker="a"} 1.0' in text
    assert 'x_total{proxy="p1",worker="a"} 5.0' in text
    assert 'g{proxy="p0"} 2.0' in text


def test_bad_group_options_are_refused_by_name() -> None:
    from stages.errors import EldrError
    from stages.serve.deploy import ServeOptions

    with pytest.raises(EldrError, match="--online-refit runs in one proxy"):
        ServeOptions(proxy_workers=2, online_refit=True).check()
    with pytest.raises(EldrError, match="--proxy-workers must be >= 1"):
        ServeOptions(proxy_workers=0).check()
    with pytest.raises(EldrError, match="the http:// address of another proxy"):
        ServeOptions(peers=("10.0.0.2:8000",)).check()


def test_a_killed_process_is_replaced_and_no_connection_waits_on_its_socket(
        workers: list[BackgroundServer]) -> None:
    """A process killed under load: the kernel must stop handing new connections to its
    socket at once (the first process still holds it open) and a new process takes its place.
    Without that about half the connections here would hang until the client gave up."""
    port = free_port()
    proc = _group(workers, port, 2)
    url = f"http://127.0.0.1:{port}"
    waits: list[float] = []
    failures: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:  # a new connection each: the kernel picks a listener per connection
                with httpx.Client(base_url=url, timeout=5) as client:
                    client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2})
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
            waits.append(time.monotonic() - t0)

    try:
        wait_healthy(url, 60, proc.poll, interval_s=0.1)
        [child] = _children(proc.pid, 1)
        _names_seen(url, 2)
        threads = [threading.Thread(target=load) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        os.kill(child, signal.SIGKILL)
        time.sleep(4)
        stop.set()
        for t in threads:
            t.join()
        assert max(waits) < 2.0, sorted(waits)[-5:]
        # Only connections the killed process held (or had queued) are cut.
        assert len(failures) <= 6, failures
        [replacement] = [p for p in _children(proc.pid, 1) if p != child]
        assert _alive(replacement) and not _alive(child)
        _names_seen(url, 2)  # the replacement serves its share again
        assert "Traceback" not in _stop_group(proc)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
        for pid in _children_left(proc.pid):
            os.kill(pid, signal.SIGKILL)


def _stop_group(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    return proc.stderr.read()
