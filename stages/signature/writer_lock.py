"""One writer per signature dataset: an exclusive ``flock`` on a file inside the store.

Every writable open trims the rows past the commit mark (what a killed run left half-written),
so a second writer would cut the first one's append under way in half. The lock is the
kernel's: it goes with the process that holds it, kill -9 included, so a crashed recorder never
leaves a store locked. Readers take no lock (they read the committed rows only).

The file keeps the holder's pid, for the message that refuses a second writer.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from stages.errors import EldrError

LOCK_NAME = ".eldr-writer.lock"


class WriterLock:
    """Held from :meth:`take` until :meth:`release` or the holder's exit."""

    def __init__(self, fd: int, store: Path) -> None:
        self._fd: int | None = fd
        self.store = store

    @classmethod
    def take(cls, store: Path) -> WriterLock:
        """Lock ``store`` (a directory, created if absent) for writing, or refuse naming the
        holder."""
        taken = cls._try(store)
        if isinstance(taken, WriterLock):
            return taken
        raise _refusal(store, taken)

    @classmethod
    def take_unless_held_by(cls, store: Path, owner: int) -> WriterLock | None:
        """As :meth:`take`, but None while process ``owner`` holds it: an appender's writer
        process writes under the lock of the live process that started it."""
        taken = cls._try(store)
        if isinstance(taken, WriterLock):
            return taken
        if taken == str(owner):
            return None
        raise _refusal(store, taken)

    @classmethod
    def _try(cls, store: Path) -> WriterLock | str:
        """The lock, or the pid its holder wrote ("?" if it has not yet)."""
        try:
            store.mkdir(parents=True, exist_ok=True)
            fd = os.open(store / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # a read-only place, a file in the way
            raise EldrError(f"cannot write a signature dataset at {store}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            return holder
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, store)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    # A writable dataset dropped without ``close`` lets the next writer in.
    __del__ = release


def _refusal(store: Path, holder: str) -> EldrError:
    return EldrError(
        f"{store} is being written by process {holder} (one writer per dataset): stop that"
        f" process, or write to another path"
    )
