"""No process eldr started outlives it: `eldr capture` killed with SIGKILL mid-run, and
`eldr serve` stopped by SIGTERM or SIGKILL while its vLLM workers are still starting.

Every process is killed as soon as vLLM's engine processes exist, so no test waits for a
server to become ready.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import free_port, requires_vllm
from tests.proc_probe import command, tree, wait_gone

pytestmark = [requires_vllm, pytest.mark.vllm]


def _eldr(args: list[str], home: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "eldr_cli", *args], env={**os.environ, "ELDR_HOME": str(home)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _wait_for(proc: subprocess.Popen[str], seen: set[int], done: Callable[[set[int]], bool],
              timeout_s: float = 240) -> None:
    """Collect ``proc``'s descendants into ``seen`` until ``done(seen)``."""
    deadline = time.monotonic() + timeout_s
    while not done(seen):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, f"not reached; seen: {sorted(map(command, seen))}"
        seen |= tree(proc.pid)
        time.sleep(0.3)


def _named(seen: set[int], name: str) -> int:
    return sum(1 for pid in seen if name in command(pid))


def test_sigkill_of_eldr_capture_leaves_no_engine_process(tmp_path: Path) -> None:
    proc = _eldr(["capture", "--model", "tiny", "--limit", "256", "--enforce-eager",
                  "--out", str(tmp_path / "sig.zarr")], tmp_path)
    seen: set[int] = set()
    try:
        _wait_for(proc, seen, lambda s: _named(s, "VLLM::Worker") >= 1)
        time.sleep(1.5)  # capture's watchdog refreshes its list of processes twice a second
        seen |= tree(proc.pid)
        # Named while they live: once capture is killed its watchdog may take the engine down
        # before a name read after the kill (CI read none once).
        engine_cores = _named(seen, "VLLM::EngineCore")
    finally:
        proc.kill()
        proc.wait()
    assert engine_cores == 1
    assert wait_gone(seen, 10) == set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_eldr_serve_stopped_during_start_up_leaves_nothing(tmp_path: Path, sig: int) -> None:
    proc = _eldr(["serve", "--model", "tiny", "--policy", "rr", "--prefill", "1", "--decode",
                  "1", "--port", str(free_port()), "--worker-port", str(free_port())], tmp_path)
    seen: set[int] = set()
    try:
        # Both workers' engine cores exist: the launch is well under way, nothing is ready.
        _wait_for(proc, seen, lambda s: _named(s, "VLLM::EngineCore") >= 2)
        seen |= tree(proc.pid)
        proc.send_signal(sig)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Gone within 30 s of its exit: a dying vLLM process frees gigabytes, which took over 10 s
    # once on an oversubscribed CI machine.
    assert wait_gone(seen, 30) == set()
    if sig == signal.SIGTERM:
        assert proc.returncode == 130  # the CLI's "interrupted", after stopping every worker
