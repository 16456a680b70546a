"""The design card's four commands, in sequence, as a new user types them: `eldr capture`,
`eldr fit --k 20 --balanced`, `eldr serve`, `eldr bench` (a small capture and bench; ports
moved off the defaults so a busy machine cannot collide). 20 clusters on the default 2 decode
workers: the elastic pool spreads them, 10 per worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, requires_vllm
from tests.proc_probe import wait_healthy

pytestmark = [requires_vllm, pytest.mark.vllm]


def _eldr(*args: str, env: dict[str, str], timeout: int = 600) -> str:
    result = subprocess.run([sys.executable, "-m", "eldr_cli", *args], capture_output=True,
                            text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_capture_fit_k20_serve_bench(tmp_path: Path) -> None:
    env = {**os.environ, "ELDR_HOME": str(tmp_path)}
    _eldr("capture", "--limit", "60", "--max-tokens", "4", env=env)
    _eldr("fit", "--k", "20", "--balanced", env=env)
    port, worker_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [sys.executable, "-m", "eldr_cli", "serve", "--port", str(port),
         "--worker-port", str(worker_port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_healthy(serve, url, 500, lambda: serve.stdout.read() if serve.stdout else "")
        state = httpx.get(f"{url}/admin/state", timeout=10).json()
        assert state["policy"] == "eldr"
        assert [len(w["clusters"]) for w in state["decode_workers"]] == [10, 10]
        out = tmp_path / "results"
        _eldr("bench", "--url", url, "--policies", "eldr,jsq", "--num-prompts", "8",
              "--rounds", "1", "--max-tokens", "8", "--request-rate", "inf",
              "--result-dir", str(out), env=env)
        results = [json.loads(p.read_text()) for p in out.glob("*.json")]
        runs = [r for r in results if r.get("completed") is not None]
        assert runs and all(r["completed"] == 8 and r["failed"] == 0 for r in runs), results
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)
