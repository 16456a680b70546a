"""One of three decode workers killed under load: every request still succeeds.

One `eldr serve --prefill 1 --decode 3` on a K=3 artifact (captured and fitted here, small)
serves the module. For each policy, 6 clients keep non-streaming requests going; 4 s in, one
decode worker's API server gets SIGKILL. Requests it was decoding are retried on the others
(nothing had reached the client), later ones are routed around it while it is down, and it
serves again once restarted. For the centroid policy the dead worker's cluster must have moved
to a live worker while it was down (the elastic pool), with no refit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, requires_vllm
from tests.proc_probe import api_server, serve_log, start_serve, tree, wait_gone, wait_healthy

pytestmark = [requires_vllm, pytest.mark.vllm]

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Solve: 3 + 4 =", "Once upon a time",
    "import numpy as np\n", "The mitochondria is", "SELECT name FROM", "Dear Sir or Madam,",
]
CLIENTS = 6
BEFORE_KILL_S, AFTER_KILL_S = 4.0, 20.0


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    worker_port: int
    log: Path
    started: set[int]

    def state(self) -> dict[str, object]:
        return httpx.get(f"{self.url}/admin/state", timeout=10).json()  # type: ignore[no-any-return]

    def decode_api_server(self, index: int) -> int:
        return api_server(self.proc.pid, self.worker_port + 1 + index)  # prefill is first


def _eldr(*args: str, env: dict[str, str]) -> None:
    result = subprocess.run([sys.executable, "-m", "eldr_cli", *args], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("home")
    env = {**os.environ, "ELDR_HOME": str(home)}
    _eldr("capture", "--limit", "60", "--max-tokens", "4", env=env)
    _eldr("fit", "--k", "3", "--balanced", env=env)
    port, worker_port = free_port(), free_port()
    log = serve_log(home)
    proc = start_serve(
        ["--model", "tiny", "--policy", "eldr", "--prefill", "1", "--decode", "3", "--port",
         str(port), "--worker-port", str(worker_port), "--log-level", "info",
         # Fail-over, not compilation, is under test: eager workers restart faster.
         "--enforce-eager"],
        home, env,
    )
    served = Served(proc, f"http://127.0.0.1:{port}", worker_port, log, set())

    def seen() -> None:
        served.started |= tree(proc.pid)

    try:
        wait_healthy(proc, served.url, 500, log.read_text, on_poll=seen)
        yield served
    finally:
        seen()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        wait_gone(served.started, 30)


def _wait_decode_healthy(served: Served, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = served.state()["decode_workers"]
        if sum(bool(w["healthy"]) for w in workers) == count:  # type: ignore[union-attr]
            return
        time.sleep(1)
    pytest.fail(f"decode workers not {count} healthy:\n{served.log.read_text()[-3000:]}")


@dataclass(frozen=True)
class Outcome:
    started_s: float
    status: int
    detail: str


def _load(url: str, stop: threading.Event, client: int) -> list[Outcome]:
    """One client's requests, one after another, until ``stop``."""
    outcomes = []
    i = client
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            body = {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16,
                    "temperature": 0, "ignore_eos": True}
            started = time.monotonic()
            try:
                response = http.post(f"{url}/v1/completions", json=body)
                outcomes.append(Outcome(started, response.status_code, response.text[:300]))
            except httpx.HTTPError as exc:
                outcomes.append(Outcome(started, -1, repr(exc)))
            i += CLIENTS
    return outcomes


@pytest.mark.parametrize("policy", ["eldr-union", "eldr"])
def test_a_decode_worker_killed_under_load_fails_no_request(served: Served, policy: str) -> None:
    _wait_decode_healthy(served, 3, 240)  # the previous case's victim is back
    switched = httpx.post(f"{served.url}/admin/policy", json={"policy": policy}, timeout=10)
    assert switched.status_code == 200, switched.text
    victim_index = 1
    victim = served.decode_api_server(victim_index)
    served.started |= tree(served.proc.pid)
    stop = threading.Event()
    moved: list[list[int]] = []
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(_load, served.url, stop, c) for c in range(CLIENTS)]
        try:
            time.sleep(BEFORE_KILL_S)
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            # While the victim is out of routing, its clusters live on the other workers.
            while time.monotonic() - killed < AFTER_KILL_S:
                workers = served.state()["decode_workers"]
                if not workers[victim_index]["healthy"]:  # type: ignore[index]
                    moved.append([len(w["clusters"]) for w in workers])  # type: ignore[union-attr]
                time.sleep(0.5)
        finally:
            stop.set()
        outcomes = [o for f in futures for o in f.result()]
    after = [o for o in outcomes if o.started_s >= killed]
    failed = [o for o in outcomes if o.status != 200]
    assert failed == [], failed[:5]
    assert len(after) >= CLIENTS, f"only {len(after)} requests after the kill"
    assert moved, "the killed worker never left routing"
    if policy == "eldr":
        # K=3 on 3 workers: the dead worker's cluster is served by a live one meanwhile.
        assert all(m[victim_index] == 0 and sum(m) == 3 for m in moved), moved
    _wait_decode_healthy(served, 3, 240)
    assert served.decode_api_server(victim_index) != victim
    print(f"\n{policy}: {len(outcomes)} requests, {len(after)} started after the SIGKILL, none"
          f" failed; clusters per worker while it was down: {moved[-1]}")
