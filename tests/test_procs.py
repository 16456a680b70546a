"""Keeper and watchdog with small real processes: what eldr starts dies with it, SIGKILL too.

Each test runs an "owner" Python process (standing in for `eldr serve` or `eldr capture`) that
starts a tree of sleeping processes the way vLLM does (an API server whose engine core is its
child, a grandchild that outlives its parent), reports their pids, and is then killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stages.procs import linux
from tests.conftest import free_port

# A process that starts a child which starts a grandchild (for depth 2), prints their pids, and
# sleeps: the shape of vLLM's api_server -> EngineCore -> Worker.
_TREE = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    depth = int(sys.argv[1])
    below = []
    if depth > 0:
        child = subprocess.Popen([sys.executable, __file__, str(depth - 1)],
                                 stdout=subprocess.PIPE, text=True)
        below = json.loads(child.stdout.readline())
    print(json.dumps([os.getpid(), *below]), flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    info = linux.read_info(pid)
    return info is not None and not info.zombie


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _owner(script: str, tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    tree = tmp_path / "tree.py"
    tree.write_text(_TREE)
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), str(tree)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    assert owner.stdout is not None
    line = owner.stdout.readline()
    assert line, "the owner exited before reporting its tree"
    return owner, json.loads(line)


_SERVE_LIKE = """
    import json, subprocess, sys, time
    from stages.procs import keeper
    proc = keeper.spawn([sys.executable, sys.argv[1], "2"], dict(__import__("os").environ),
                        subprocess.PIPE)
    below = json.loads(proc.stdout.readline())
    print(json.dumps([proc.pid, *below]), flush=True)
    time.sleep(600)
"""


def test_sigkill_of_the_owner_ends_the_keepers_whole_tree(tmp_path: Path) -> None:
    owner, pids = _owner(_SERVE_LIKE, tmp_path)
    try:
        keeper_pid, api, engine = pids[0], pids[1], pids[2]
        assert all(_alive(p) for p in pids) and len(pids) == 4
        # The keeper leads the group holding the whole tree, so eldr's killpg reaches it all.
        assert {linux.read_info(p).pgid for p in pids} == {keeper_pid}  # type: ignore[union-attr]
        assert linux.read_info(engine).ppid == api  # type: ignore[union-attr]
    finally:
        owner.kill()
        owner.wait()
    assert _wait_gone(pids, 5.0) == []


def test_a_command_that_exits_takes_its_leftovers_along_and_passes_its_status(
    tmp_path: Path,
) -> None:
    from stages.procs import keeper

    tree = tmp_path / "tree.py"
    tree.write_text(_TREE)
    # The command starts a tree, reports it, and exits 3 leaving the tree behind (an API
    # server that died while its engine core lives on).
    command = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, {str(tree)!r}, '1'], stdout=subprocess.PIPE)\n"
        "sys.stdout.buffer.write(p.stdout.readline()); sys.stdout.flush()\n"
        "import os; os._exit(3)\n"
    )
    proc = keeper.spawn([sys.executable, "-c", command], dict(os.environ), subprocess.PIPE)
    assert proc.stdout is not None
    left = json.loads(proc.stdout.readline())
    assert proc.wait(10) == 3
    assert _wait_gone(left, 1.0) == []  # gone by the time the keeper's exit is seen


def test_group_sigterm_reaches_the_command_and_the_keeper_reports_it(tmp_path: Path) -> None:
    from stages.procs import keeper

    tree = tmp_path / "tree.py"
    tree.write_text(_TREE)
    proc = keeper.spawn([sys.executable, str(tree), "1"], dict(os.environ), subprocess.PIPE)
    assert proc.stdout is not None
    pids = json.loads(proc.stdout.readline())
    os.killpg(proc.pid, signal.SIGTERM)  # what VllmServer.terminate sends
    assert proc.wait(10) == 128 + signal.SIGTERM
    assert _wait_gone(pids, 1.0) == []


def test_a_keeper_whose_owner_is_already_gone_starts_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    owner = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(owner.stdout)
    result = subprocess.run(
        [sys.executable, "-m", "stages.procs.keeper", str(dead), "--", "touch", str(marker)],
        timeout=30,
    )
    assert result.returncode == 1 and not marker.exists()


_CAPTURE_LIKE = """
    import json, subprocess, sys, time
    from stages.procs.watchdog import Watchdog
    watchdog = Watchdog()
    child = subprocess.Popen([sys.executable, sys.argv[1], "1"], stdout=subprocess.PIPE,
                             text=True)
    below = json.loads(child.stdout.readline())
    time.sleep(1.2)  # the watchdog refreshes its list twice a second
    print(json.dumps([watchdog.pid, *below]), flush=True)
    time.sleep(600)
"""


def test_sigkill_of_an_in_process_engines_owner_ends_its_children(tmp_path: Path) -> None:
    owner, pids = _owner(_CAPTURE_LIKE, tmp_path)
    try:
        watchdog, engine_core, worker = pids
        assert all(_alive(p) for p in pids)
    finally:
        owner.kill()
        owner.wait()
    assert _wait_gone([engine_core, worker, watchdog], 5.0) == []


def test_a_closed_watchdog_is_gone_and_killed_nothing(tmp_path: Path) -> None:
    from stages.procs.watchdog import Watchdog

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with Watchdog() as watchdog:
            time.sleep(0.7)
        assert not _alive(watchdog.pid)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_descendants_and_pid_reuse_safety() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        found = {info.pid: info for info in linux.descendants(os.getpid())}
        assert child.pid in found
        stale = found[child.pid]
        # A recorded process whose pid now names a newer one is left alone.
        linux.kill(linux.ProcInfo(stale.pid, stale.ppid, stale.pgid, "S", stale.start_time + 1))
        assert child.poll() is None
        linux.kill(stale)
        assert child.wait(5) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_off_linux_serve_refuses_to_start_workers_and_capture_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """macOS and the like: a clear refusal naming --attach-*, never a traceback half-way; a
    capture runs without its watchdog and says so."""
    from stages.errors import EldrError
    from stages.procs import platform_check
    from stages.procs.watchdog import Watchdog
    from stages.serve.deploy import ServeOptions, plan

    monkeypatch.setattr(platform_check.sys, "platform", "darwin")
    with pytest.raises(EldrError, match="--attach-prefill URL --attach-decode URL"):
        plan(ServeOptions(policy="rr", port=free_port()))
    with caplog.at_level("WARNING"), Watchdog() as watchdog:
        assert watchdog.pid is None
    assert "no orphan protection on darwin" in caplog.text
