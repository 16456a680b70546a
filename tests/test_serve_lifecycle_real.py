"""`eldr serve` as users run it: real workers, a prefill variant handing KV to the decode
model, and SIGTERM leaving no process behind.

One `eldr serve` process serves the module: decode runs a widened tiny (zero expert units,
routing-identical) over two tensor-parallel ranks (on CPU both on the decode worker's core),
prefill runs tiny itself (--prefill-model), as the demo does. The workers run eager: the
hand-off between two models and the shutdown are under test here, while compiled recording
over two tensor-parallel ranks is `test_capture_real.py`'s (three compilations saved).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, requires_vllm
from tests.proc_probe import wait_healthy

pytestmark = [requires_vllm, pytest.mark.vllm]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie (a dead child not yet reaped by its new parent is gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str
    decode_url: str
    model: str
    workers: set[int]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from stages.model_widen import ensure_wide_model

    home = tmp_path_factory.mktemp("home")
    env = {**os.environ, "ELDR_HOME": str(home)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ELDR_HOME", str(home))
        wide = str(ensure_wide_model(intermediate=1024))  # ~100 MB: quick to derive and load
    port, worker_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "eldr_cli", "serve", "--model", wide, "--prefill-model", "tiny",
         "--policy", "eldr-union", "--prefill", "1", "--decode", "1", "--decode-tp", "2",
         "--enforce-eager", "--port", str(port),
         "--worker-port", str(worker_port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        workers: set[int] = set()
        wait_healthy(proc, f"http://127.0.0.1:{port}", 400,
                     lambda: proc.stdout.read() if proc.stdout else "",
                     on_poll=lambda: workers.update(_descendants(proc.pid)))
        yield Served(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{worker_port + 1}",
                     wide, workers)
    finally:
        if proc.poll() is None:
            proc.kill()


def _complete(url: str, model: str, prompt: str, max_tokens: int = 8) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


def test_prefill_variant_hands_kv_to_the_wide_tensor_parallel_decode_model(
    served: Served
) -> None:
    # Ready (the fixture waited for it) meant heard: the decode worker's published batches
    # reached the proxy, so no request recorded from then on can lose its row.
    health = httpx.get(f"{served.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["unheard_streams"] == [], health
    # Prompts shorter than one KV block, so the decode worker's prefix cache never serves
    # one path from the other's blocks.
    for prompt in ["def add(a, b):", "Solve: 3 + 4 ="]:
        # Alone, the decode worker computes the whole request on the wide model; through the
        # proxy, prefill ran on tiny and decode continued from its KV. Greedy outputs agree on
        # their first tokens: later ones may part on a near tie, as prefill's bf16 sums run in
        # another order on one rank than on the decode worker's two (seen at token 5 here).
        alone = _complete(served.decode_url, served.model, prompt, max_tokens=4)
        assert _complete(served.url, served.model, prompt, max_tokens=4) == alone
    external = 0.0
    for line in httpx.get(f"{served.decode_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total") and "external_kv" in line:
            external += float(line.rsplit(" ", 1)[1])
    assert external > 0  # the decode worker really loaded the prefill worker's KV
    # Both workers proved their signatures (the TP decode worker through its first rank).
    state = httpx.get(f"{served.url}/admin/state", timeout=10).json()
    for worker in state["prefill_workers"] + state["decode_workers"]:
        assert worker["self_check"]["verified"], worker
    assert all(worker["batch_endpoint"] for worker in state["decode_workers"])  # followed
    # Under a policy that reads KV, each worker's KV event stream counts too. The prompts so
    # far filled no KV block (128 tokens on CPU), so neither worker has sent an event; each
    # one's replay socket answered the proxy's first replay, with nothing, and that is heard
    # (a batch missed after it would show as a gap a replay repairs).
    assert state["kv"] is not None  # followed
    assert [w["events"] for role in ("prefill", "decode") for w in state["kv"][role]] == [0, 0]
    httpx.post(f"{served.url}/admin/policy", json={"policy": "kv"},
               timeout=10).raise_for_status()
    health = httpx.get(f"{served.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["unheard_streams"] == [], health


def test_sigterm_stops_proxy_and_every_worker(served: Served) -> None:
    workers = served.workers | _descendants(served.proc.pid)
    assert len(workers) >= 5  # two api servers, their engine cores, three worker ranks
    served.proc.send_signal(signal.SIGTERM)
    served.proc.wait(timeout=90)
    time.sleep(1)
    assert [pid for pid in workers if _alive(pid)] == []
