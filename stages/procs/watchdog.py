"""A watchdog that kills the descendants of an in-process engine's owner when the owner dies.

``eldr capture`` runs vLLM's offline ``LLM`` in its own process, and vLLM starts the engine
core and workers from there: no keeper can sit between them. So capture starts this watchdog
first. It follows the owner through a pidfd (readable once the owner has exited, however it
died) and keeps a list of the owner's descendants, refreshed every half second, since once the
owner is gone they are re-parented away and no longer look like its children. When the owner
dies it SIGKILLs every listed process still alive and anything below them. A process started
and orphaned within one refresh interval is missed; vLLM's engine processes live far longer.

The owner ends the watchdog with SIGTERM (``Watchdog.close``) once its engine is shut down.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time
from types import TracebackType

from stages.procs import linux
from stages.procs.platform_check import owns_processes

log = logging.getLogger(__name__)

_REFRESH_S = 0.5
_SWEEPS = 20


class Watchdog:
    """The running watchdog of this process (a context manager: leaving it stops the watch).
    Off Linux there is none, and the user is told the engine may outlive a killed capture."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        if not owns_processes():
            log.warning("eldr: no orphan protection on %s: if capture is killed, end its vLLM"
                        " engine processes yourself", sys.platform)
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "stages.procs.watchdog", str(os.getpid())],
            # Its own session: a Ctrl-C meant for eldr must not end the watch first.
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _sweep(watched: dict[int, linux.ProcInfo]) -> None:
    """SIGKILL the watched processes still alive and everything below them, until none is."""
    me = os.getpid()
    for _ in range(_SWEEPS):
        table = linux.process_table()
        targets = {
            info.pid: info
            for info in watched.values()
            if (now := table.get(info.pid)) is not None and now.start_time == info.start_time
        }
        for info in list(targets.values()):
            targets.update((d.pid, d) for d in linux.descendants(info.pid, table))
        targets.pop(me, None)
        live = [info for info in targets.values() if not info.zombie]
        if not live:
            return
        for info in live:
            linux.kill(info)
        watched.update((info.pid, info) for info in live)
        time.sleep(0.05)


def main(owner: int) -> int:
    try:
        owner_fd = os.pidfd_open(owner)
    except ProcessLookupError:
        return 1
    me = os.getpid()
    watched: dict[int, linux.ProcInfo] = {}
    while True:
        table = linux.process_table()
        # Pids the owner's tree no longer holds stay listed: once the owner dies, an engine
        # core it started has been re-parented and is found only through this list.
        watched.update((d.pid, d) for d in linux.descendants(owner, table) if d.pid != me)
        for pid in [pid for pid, info in watched.items() if pid not in table]:
            del watched[pid]
        ready, _, _ = select.select([owner_fd], [], [], _REFRESH_S)
        if ready:
            _sweep(watched)
            return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only SIGTERM from the owner ends the watch
    sys.exit(main(int(sys.argv[1])))
