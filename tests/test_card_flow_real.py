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
from tests.proc_probe import eldr_ok, wait_healthy

pytestmark = [requires_vllm, pytest.mark.vllm]


def test_capture_fit_k20_serve_bench(tmp_path: Path) -> None:
    env = {**os.environ, "ELDR_HOME": str(tmp_path)}
    eldr_ok("capture", "--limit", "60", "--max-tokens", "4", home=tmp_path)
    eldr_ok("fit", "--k", "20", "--balanced", home=tmp_path)
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
        eldr_ok("bench", "--url", url, "--policies", "eldr,jsq", "--num-prompts", "8",
              "--rounds", "1", "--max-tokens", "8", "--request-rate", "inf",
              "--result-dir", str(out), home=tmp_path)
        results = [json.loads(p.read_text()) for p in out.glob("*.json")]
        runs = [r for r in results if r.get("completed") is not None]
        assert runs and all(r["completed"] == 8 and r["failed"] == 0 for r in runs), results
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)
