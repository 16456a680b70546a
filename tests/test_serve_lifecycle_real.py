"""`eldr serve` as users run it: starts real workers, and SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, requires_vllm

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


def test_sigterm_stops_proxy_and_every_worker(tmp_path: Path) -> None:
    port = free_port()
    worker_port = free_port()
    env = {**os.environ, "ELDR_HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "eldr_cli", "serve", "--model", "tiny", "--policy", "jsq",
         "--prefill", "1", "--decode", "1", "--port", str(port), "--worker-port",
         str(worker_port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 400
        workers: set[int] = set()
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            workers |= _descendants(proc.pid)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("eldr serve did not become healthy")
        body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        workers |= _descendants(proc.pid)
        assert len(workers) >= 4  # two api servers, their engine cores and workers
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        time.sleep(1)
        assert [pid for pid in workers if _alive(pid)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
