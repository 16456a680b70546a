"""`eldr serve` on a vLLM release that lacks a touchpoint refuses, naming it, before any
worker starts (no engine is started here: the gate runs before the cluster exists)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port, requires_vllm
from tests.plain_reference import MISSING_TOUCHPOINT, untested_release_env

pytestmark = requires_vllm


def test_serve_refuses_a_release_missing_a_touchpoint_before_any_worker_starts(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    env = {**os.environ, **untested_release_env(tmp_path), "ELDR_HOME": str(home)}
    result = subprocess.run(
        [sys.executable, "-m", "eldr_cli", "serve", "--policy", "rr", "--port",
         str(free_port()), "--worker-port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert f"lacks what eldr's plugin relies on: {MISSING_TOUCHPOINT}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(home.rglob("vllm-*.log"))  # no worker was started
