"""The Linux process facts eldr's keeper and watchdog act on: /proc's process table and prctl.

Standard library only: the keeper and the watchdog import this module at start-up, and each
should cost a bare interpreter, not eldr's dependencies.
"""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PROC = Path("/proc")


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    state: str
    # Clock ticks after boot: with the pid, names one process even after the pid is reused.
    start_time: int

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X")


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}, {value}): {os.strerror(errno)}")


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of to init, so it can
    still find (and kill) an engine core whose API server died."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Get ``sig`` when the thread that forked this process exits (PR_SET_PDEATHSIG; not
    inherited by this process's own children)."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def read_info(pid: int) -> ProcInfo | None:
    """``/proc/<pid>/stat`` parsed; None when the process is gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses; it ends at the last ')'.
    fields = text.rsplit(")", 1)[1].split()
    return ProcInfo(pid, int(fields[1]), int(fields[2]), fields[0], int(fields[19]))


def process_table() -> dict[int, ProcInfo]:
    table: dict[int, ProcInfo] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            info = read_info(int(entry.name))
            if info is not None:
                table[info.pid] = info
    return table


def descendants(pid: int, table: dict[int, ProcInfo] | None = None) -> list[ProcInfo]:
    """Every process below ``pid`` in the parent tree (zombies included), parents first."""
    table = process_table() if table is None else table
    children: dict[int, list[ProcInfo]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info)
    found: list[ProcInfo] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child.pid)
    return found


def kill(info: ProcInfo, sig: int = signal.SIGKILL) -> None:
    """Signal this very process: a pid now naming a newer process is left alone."""
    current = read_info(info.pid)
    if current is None or current.start_time != info.start_time:
        return
    try:
        os.kill(info.pid, sig)
    except ProcessLookupError:
        pass  # exited between the check and the signal: what we wanted
