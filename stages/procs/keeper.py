"""A keeper process ties one command's whole process tree to the life of the eldr process.

vLLM's API server starts its engine core and workers with multiprocessing, so a parent-death
signal on the API server alone would leave them running. Instead eldr starts every server as

    eldr ── keeper ── api_server ── EngineCore ── Worker ...

The keeper is a child subreaper, so descendants orphaned by a crash are re-parented to it and
stay findable. It watches eldr through a pidfd (no pipe end can leak into a forked child and
keep the lifeline open) and the command through another:

- eldr exits, SIGKILL included: the keeper kills the whole tree, itself last.
- the command exits: the keeper kills what it left behind (an engine core outliving its API
  server) and exits with the command's status, so eldr sees one process end for the server.

The keeper leads the tree's process group, so eldr's ``killpg`` still reaches everything (a
graceful SIGTERM the keeper itself ignores, or SIGKILL when the grace runs out).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO

from stages.procs import linux

_REAP_LIMIT_S = 10.0


def spawn(
    argv: list[str],
    env: dict[str, str],
    stdout: IO[bytes] | int,
    cores: list[int] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` under a keeper that dies, with all it started, when this process does.

    The returned process is the keeper: its exit status is the command's, and its process
    group holds the whole tree.
    """
    command = [sys.executable, "-m", "stages.procs.keeper", str(os.getpid())]
    if cores:
        command += ["--cores", ",".join(map(str, cores))]
    return subprocess.Popen(
        [*command, "--", *argv],
        stdout=stdout,
        stderr=subprocess.STDOUT,
        env=env,
        # Its own session: Ctrl-C in eldr's terminal reaches eldr, which stops servers in order.
        start_new_session=True,
    )


# Signals eldr sends the whole group; the keeper outlives them to reap the tree.
_GROUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _child_setup(parent: int) -> Callable[[], None]:
    def setup() -> None:
        # Runs in the forked child before exec. The keeper blocked the group signals around the
        # fork: one that came meanwhile is pending here, and with the default action restored
        # first it ends the child now instead of reaching the keeper's no-op handler copy.
        for sig in _GROUP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _GROUP_SIGNALS)
        # If the keeper is killed on its own, the API server goes too (its engine core is then
        # eldr's killpg's to end).
        linux.die_with_parent(signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)

    return setup


def _end_descendants() -> None:
    """SIGKILL every descendant and reap them, until none is left (or the limit passes)."""
    me = os.getpid()
    deadline = time.monotonic() + _REAP_LIMIT_S
    while time.monotonic() < deadline:
        tree = linux.descendants(me)
        if not tree:
            return
        for info in tree:
            if not info.zombie:
                linux.kill(info)
        _reap()
        time.sleep(0.02)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _exit_status(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def main(args: list[str]) -> int:
    owner = int(args[0])
    split = args.index("--")
    options, command = args[1:split], args[split + 1 :]
    if options[:1] == ["--cores"]:
        # Inherited by the API server and every process it starts.
        os.sched_setaffinity(0, {int(c) for c in options[1].split(",")})
    linux.become_subreaper()
    try:
        owner_fd = os.pidfd_open(owner)
    except ProcessLookupError:
        return 1
    if os.getppid() != owner:
        return 1  # eldr died before we watched it: start nothing
    # Handlers, not SIG_IGN: the command must keep its default SIGTERM/SIGINT (exec resets
    # handlers, but inherits SIG_IGN).
    for sig in _GROUP_SIGNALS:
        signal.signal(sig, lambda signum, frame: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_SIGNALS)
    child = subprocess.Popen(command, preexec_fn=_child_setup(os.getpid()))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _GROUP_SIGNALS)
    child_fd = os.pidfd_open(child.pid)
    while True:
        ready, _, _ = select.select([owner_fd, child_fd], [], [])
        if owner_fd in ready:
            _end_descendants()
            os.killpg(0, signal.SIGKILL)  # anything left in the group, the keeper included
        if child_fd in ready:
            break
    status = _exit_status(child.wait())
    _end_descendants()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
