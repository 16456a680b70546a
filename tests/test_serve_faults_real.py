"""`eldr serve` under faults, against real vLLM: workers killed with SIGKILL under load and
idle, then the `eldr serve` process itself; and every socket it opened stays on loopback.

One `eldr serve --prefill 1 --decode 2` on a K=2 artifact (fitted here on the shared
calibration capture) serves the whole module, in this order:

1. listeners: every process eldr started listens on loopback only;
2. 6 clients keep non-streaming requests going on eldr-union; 4 s in, one decode worker's
   API server gets SIGKILL. Requests it was decoding are retried on the others (nothing had
   reached the client), later ones are routed around it while it is down, and it serves again
   once restarted. Mid-outage the policy is switched to eldr, whose dead worker's cluster must
   have moved to a live worker while it was down (the elastic pool), with no refit;
3. with no traffic, a decode worker's API server and the prefill worker's engine core are
   killed at once: each leaves routing within 5 s and serves again within 4 min (a restart on
   this 2-core machine, beside a running worker), having passed the self-check again, no
   request failing after;
4. last, `eldr serve` itself gets SIGKILL: nothing it started may be left 10 s later.

Workers run eager: fail-over and supervision, not compilation, are under test, and eager
workers restart faster. Two decode workers, not more: every PD worker's NIXL progress thread
keeps a core busy on CPU, and restarts beside four such workers took three minutes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import home_with, requires_vllm
from tests.proc_probe import (
    Served,
    command,
    eldr_ok,
    listeners,
    running_serve,
    tree,
    wait_gone,
)

pytestmark = [requires_vllm, pytest.mark.vllm]

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Solve: 3 + 4 =", "Once upon a time",
    "import numpy as np\n", "The mitochondria is", "SELECT name FROM", "Dear Sir or Madam,",
]
DECODE = 2
CLIENTS = 6
BEFORE_KILL_S, AFTER_KILL_S = 4.0, 20.0
SWITCH_AFTER_S = 3.0  # eldr-union serves the first seconds of the outage, eldr the rest
LOAD_VICTIM = 1  # the decode worker killed under load, once per policy
IDLE_VICTIM = 0  # the decode worker killed with no traffic, once


@pytest.fixture(scope="module")
def served(calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = home_with(calibration, tmp_path_factory.mktemp("faults"))
    eldr_ok("fit", "--k", str(DECODE), "--balanced", "--no-plot", home=home)
    with running_serve(
        ["--model", "tiny", "--policy", "eldr", "--prefill", "1", "--decode", str(DECODE),
         "--log-level", "info", "--enforce-eager"], home,
    ) as served:
        yield served


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_every_listener_of_every_started_process_is_on_loopback(served: Served) -> None:
    # A request first: NIXL's handshake and UCX's endpoints exist once KV has moved.
    assert _complete(served.url, PROMPTS[0]).status_code == 200
    found = listeners(served.seen() | {served.proc.pid})
    assert any(f.port == served.worker_port for f in found)  # the probe sees the workers
    assert [f for f in found if not f.loopback] == []


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


def test_a_decode_worker_killed_under_load_fails_no_request_under_either_policy(
    served: Served,
) -> None:
    """One outage serves both policies: eldr-union when the worker dies, eldr once it has left
    routing (an operator switching policy mid-outage), so one restart is paid, not two."""
    _wait_decode_healthy(served, DECODE, 300)
    assert _set_policy(served, "eldr-union").status_code == 200
    victim = served.decode_api_server(LOAD_VICTIM)
    served.seen()
    stop = threading.Event()
    moved: list[list[int]] = []
    switched_at = None
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(_load, served.url, stop, c) for c in range(CLIENTS)]
        try:
            time.sleep(BEFORE_KILL_S)
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            while time.monotonic() - killed < AFTER_KILL_S:
                workers = served.state()["decode_workers"]
                down = not workers[LOAD_VICTIM]["healthy"]  # type: ignore[index]
                if down and switched_at is None and time.monotonic() - killed > SWITCH_AFTER_S:
                    switched = _set_policy(served, "eldr")
                    assert switched.status_code == 200, switched.text
                    switched_at = time.monotonic()
                elif down and switched_at is not None:
                    # While the victim is out of routing, its cluster lives on the other worker.
                    moved.append([len(w["clusters"]) for w in workers])  # type: ignore[union-attr]
                time.sleep(0.5)
        finally:
            stop.set()
        outcomes = [o for f in futures for o in f.result()]
    failed = [o for o in outcomes if o.status != 200]
    assert failed == [], failed[:5]
    union_after = [o for o in outcomes if killed <= o.started_s < (switched_at or killed)]
    eldr_after = [o for o in outcomes if switched_at is not None and o.started_s >= switched_at]
    assert switched_at is not None, "the killed worker never left routing"
    assert len(union_after) >= CLIENTS, f"only {len(union_after)} eldr-union requests after it"
    assert len(eldr_after) >= CLIENTS, f"only {len(eldr_after)} eldr requests after the switch"
    assert moved, "the worker came back before eldr saw it down"
    # K=2 on 2 workers: the dead worker's cluster is served by the live one meanwhile.
    assert all(m[LOAD_VICTIM] == 0 and sum(m) == DECODE for m in moved), moved
    _wait_decode_healthy(served, DECODE, 300)
    assert served.decode_api_server(LOAD_VICTIM) != victim
    print(f"\n{len(outcomes)} requests, {len(union_after)} on eldr-union after the SIGKILL,"
          f" {len(eldr_after)} on eldr after the switch, none failed; clusters per worker while"
          f" it was down: {moved[-1]}")


def _set_policy(served: Served, policy: str) -> httpx.Response:
    return httpx.post(f"{served.url}/admin/policy", json={"policy": policy}, timeout=10)


# The decode worker loses its API server; the prefill worker only its engine core, which
# leaves vLLM's API server running and answering /health with 503. Both at once: each
# recovery is its own, and one wait serves both.
VICTIMS = (("decode", IDLE_VICTIM, "api server"), ("prefill", 0, "engine core"))


def test_killed_workers_leave_routing_at_once_and_serve_again(served: Served) -> None:
    _wait_decode_healthy(served, DECODE, 300)
    everyone = {"decode_healthy": DECODE, "prefill_healthy": 1}
    assert {k: served.health()[k] for k in everyone} == everyone
    targets = []
    for role, index, victim in VICTIMS:
        api = served.api_server(served.worker_port + (1 + index if role == "decode" else 0))
        if victim == "engine core":
            api = next(p for p in tree(api) if "VLLM::EngineCore" in command(p))
        targets.append(api)
    served.seen()
    for target in targets:
        os.kill(target, signal.SIGKILL)
    killed = time.monotonic()
    down = {k: v - 1 for k, v in everyone.items()}
    while {k: served.health().get(k) for k in everyone} != down:
        assert time.monotonic() - killed < 5, f"still routed 5 s after the kills: {served.health()}"
        time.sleep(0.2)
    out = time.monotonic() - killed
    while {k: served.health().get(k) for k in everyone} != everyone:
        assert time.monotonic() - killed < 240, (
            f"workers not back within 4 min:\n{served.log.read_text()[-3000:]}"
        )
        served.seen()
        time.sleep(1)
    back = time.monotonic() - killed
    for prompt in PROMPTS:
        response = _complete(served.url, prompt)
        assert response.status_code == 200, response.text
    state = served.state()
    metrics = httpx.get(f"{served.url}/metrics", timeout=5).text
    # It rejoined only after its self-check passed again: once at start, once after restart.
    assert state["self_check"] == "on"
    for role, index, _ in VICTIMS:
        worker = state[f"{role}_workers"][index]  # type: ignore[index]
        name = f"{role}-{index}"
        assert worker["restarts"] == 1, (name, worker)
        assert f'eldr_worker_restarts_total{{worker="{name}"}} 1.0' in metrics
        assert worker["self_check"] == {"verified": True, "passed": 2, "failed": 0}, name
        passes = f'eldr_worker_self_check_passes_total{{role="{role}",worker="{name}"}} 2.0'
        assert passes in metrics
    print(f"\ndecode API server and prefill engine core out of routing {out:.1f} s and back"
          f" {back:.0f} s after their SIGKILL")


def test_sigkill_of_eldr_serve_leaves_no_process_it_started(served: Served) -> None:
    started = served.seen()
    assert len(started) >= 9  # three keepers, their API servers, engine cores and workers
    served.proc.kill()
    served.proc.wait()
    killed = time.monotonic()
    assert wait_gone(started, 10) == set()
    print(f"\n{len(started)} processes eldr serve started gone {time.monotonic() - killed:.1f} s"
          " after its SIGKILL")
