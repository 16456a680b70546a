"""`eldr serve` heals itself and stays on loopback: real workers killed with SIGKILL, then the
`eldr serve` process itself.

One `eldr serve --prefill 1 --decode 1` serves the whole module, in this order: listeners are
checked on loopback, the decode worker and then the prefill worker are killed with no traffic
(each must leave routing within 5 s and serve again within 2 min, having passed the self-check
again, no request failing after), and last `eldr serve` is killed with SIGKILL: nothing it
started may be left 10 s later.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, requires_vllm
from tests.proc_probe import (
    api_server,
    command,
    listeners,
    serve_log,
    start_serve,
    tree,
    wait_gone,
    wait_healthy,
)

pytestmark = [requires_vllm, pytest.mark.vllm]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Solve: 3 + 4 =", "Once upon a"]


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    worker_port: int
    log: Path
    started: set[int] = field(default_factory=set)  # every process seen below eldr serve

    def seen(self) -> set[int]:
        self.started |= tree(self.proc.pid)
        return self.started

    def health(self) -> dict[str, object]:
        """The proxy's /health; empty while it does not answer in time (a loaded machine)."""
        try:
            return httpx.get(f"{self.url}/health", timeout=5).json()  # type: ignore[no-any-return]
        except httpx.HTTPError:
            return {}

    def api_server(self, port: int) -> int:
        return api_server(self.proc.pid, port)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("home")
    port, worker_port = free_port(), free_port()
    log = serve_log(home)
    proc = start_serve(
        ["--model", "tiny", "--policy", "rr", "--prefill", "1", "--decode", "1", "--port",
         str(port), "--worker-port", str(worker_port), "--log-level", "info",
         # Supervision, not compilation, is under test: eager workers restart faster.
         "--enforce-eager"],
        home, {**os.environ, "ELDR_HOME": str(home)},
    )
    served = Served(proc, f"http://127.0.0.1:{port}", worker_port, log)
    try:
        wait_healthy(proc, served.url, 400, log.read_text, on_poll=served.seen)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        wait_gone(served.started, 30)


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_every_listener_of_every_started_process_is_on_loopback(served: Served) -> None:
    # A request first: NIXL's handshake and UCX's endpoints exist once KV has moved.
    assert _complete(served.url, PROMPTS[0]).status_code == 200
    found = listeners(served.seen() | {served.proc.pid})
    assert any(f.port == served.worker_port for f in found)  # the probe sees the workers
    assert [f for f in found if not f.loopback] == []


# The decode worker loses its API server; the prefill worker only its engine core, which
# leaves vLLM's API server running and answering /health with 503.
@pytest.mark.parametrize(("role", "offset", "victim"), [("decode", 1, "api server"),
                                                        ("prefill", 0, "engine core")])
def test_a_killed_worker_leaves_routing_at_once_and_serves_again(
    served: Served, role: str, offset: int, victim: str
) -> None:
    key = f"{role}_healthy"
    assert served.health()[key] == 1
    api = served.api_server(served.worker_port + offset)
    target = api
    if victim == "engine core":
        target = next(p for p in tree(api) if "VLLM::EngineCore" in command(p))
    served.seen()
    os.kill(target, signal.SIGKILL)
    killed = time.monotonic()
    while served.health().get(key) != 0:
        assert time.monotonic() - killed < 5, f"{role} worker still routed 5 s after its death"
        time.sleep(0.2)
    out = time.monotonic() - killed
    while served.health().get(key) != 1:
        assert time.monotonic() - killed < 120, (
            f"{role} worker not back within 2 min:\n{served.log.read_text()[-3000:]}"
        )
        served.seen()
        time.sleep(1)
    back = time.monotonic() - killed
    assert served.api_server(served.worker_port + offset) != api
    for prompt in PROMPTS * 2:
        response = _complete(served.url, prompt)
        assert response.status_code == 200, response.text
    state = httpx.get(f"{served.url}/admin/state", timeout=5).json()
    assert [w["restarts"] for w in state[f"{role}_workers"]] == [1]
    metrics = httpx.get(f"{served.url}/metrics", timeout=5).text
    assert f'eldr_worker_restarts_total{{worker="{role}-0"}} 1.0' in metrics
    # It rejoined only after its self-check passed again: once at start, once after restart.
    assert state["self_check"] == "on"
    assert state[f"{role}_workers"][0]["self_check"] == {"verified": True, "passed": 2,
                                                         "failed": 0}
    passes = f'eldr_worker_self_check_passes_total{{role="{role}",worker="{role}-0"}} 2.0'
    assert passes in metrics
    print(f"\n{role} worker out of routing {out:.1f} s and back {back:.0f} s after SIGKILL of"
          f" its {victim}")


def test_sigkill_of_eldr_serve_leaves_no_process_it_started(served: Served) -> None:
    started = served.seen()
    assert len(started) >= 6  # two keepers, their API servers, engine cores and workers
    served.proc.kill()
    served.proc.wait()
    killed = time.monotonic()
    assert wait_gone(started, 10) == set()
    print(f"\n{len(started)} processes eldr serve started gone {time.monotonic() - killed:.1f} s"
          " after its SIGKILL")
