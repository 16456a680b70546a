"""Restart the workers `eldr serve` started when their process ends, with backoff.

One job: keep started worker processes running. A worker counts as ended when its process
exited, or when it has said for a few seconds that its engine died: vLLM's API server outlives
a dead engine core, answering ``/health`` with 503, until a request happens to fail on it.
Whether a worker gets traffic is the proxy's
health probes' call (stages.serve.proxy.ops.health): a restarted worker rejoins routing once its
``/health`` answers, and a dead one leaves it at the next probe. The supervisor runs in a
thread of the `eldr serve` process beside the proxy's event loop, so a restart (a process
start) never blocks request handling; the proxy reads the restart counts for its metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class Worker(Protocol):
    """What the supervisor needs of one started worker (stages.engine.VllmServer)."""

    @property
    def url(self) -> str: ...

    @property
    def started_at(self) -> float: ...  # time.monotonic() at its start

    @property
    def log_path(self) -> Path: ...

    def exit_code(self) -> int | None: ...

    def engine_dead(self) -> bool: ...  # runs, but says its engine died (vLLM's /health 503)


class Workers(Protocol):
    """The started workers and how to replace one (stages.serve.cluster.launcher.Cluster)."""

    @property
    def servers(self) -> Sequence[Worker]: ...

    def restart(self, index: int) -> Worker: ...


@dataclass(frozen=True)
class Backoff:
    first_s: float = 1.0
    max_s: float = 60.0
    # A worker that ran this long before it ended had been serving: its next restart waits
    # ``first_s`` again instead of continuing the doubling of a crash loop.
    stable_s: float = 120.0
    # How long a running worker must keep saying its engine died before it counts as ended
    # (one answer could come from a shutdown already under way).
    dead_engine_s: float = 3.0

    def delay(self, failures: int) -> float:
        return min(self.max_s, self.first_s * 2.0 ** max(0, failures - 1))


class Supervisor:
    def __init__(
        self,
        workers: Workers,
        backoff: Backoff = Backoff(),
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._workers = workers
        self._backoff = backoff
        self._poll_s = poll_s
        self._clock = clock
        count = len(workers.servers)
        self._restarts: dict[str, int] = {s.url: 0 for s in workers.servers}
        self._failures = [0] * count  # runs in a row shorter than backoff.stable_s
        self._due: dict[int, float] = {}  # worker index -> when to restart it
        self._dead_since: dict[int, float] = {}  # worker index -> first "engine died" answer
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def restarts(self, url: str) -> int:
        """Restarts of the worker at ``url`` so far (0 for one the supervisor does not own)."""
        return self._restarts.get(url, 0)

    def check(self) -> None:
        """One pass: schedule restarts of workers found ended, start those that are due."""
        now = self._clock()
        for index, server in enumerate(self._workers.servers):
            due = self._due.get(index)
            if due is not None:
                if now >= due:
                    del self._due[index]
                    self._restart(index, server.url)
                continue
            why = self._ended(index, server, now)
            if why is not None:
                self._schedule(index, server, why, now)

    def _ended(self, index: int, server: Worker, now: float) -> str | None:
        code = server.exit_code()
        if code is not None:
            return f"exited with code {code}"
        if not server.engine_dead():
            self._dead_since.pop(index, None)
            return None
        since = self._dead_since.setdefault(index, now)
        if now - since < self._backoff.dead_engine_s:
            return None
        return f"has answered /health 503 (its engine died) for {now - since:.0f} s"

    def _schedule(self, index: int, server: Worker, why: str, now: float) -> None:
        self._dead_since.pop(index, None)
        ran = now - server.started_at
        self._failures[index] = 1 if ran >= self._backoff.stable_s else self._failures[index] + 1
        delay = self._backoff.delay(self._failures[index])
        self._due[index] = now + delay
        log.warning(
            "worker %s %s after %.0f s up; restarting in %.0f s (see %s)",
            server.url, why, ran, delay, server.log_path,
        )

    def _restart(self, index: int, url: str) -> None:
        try:
            self._workers.restart(index)
        except OSError:
            # Could not even start the process (no memory, fd limit): try again later, the
            # delay growing as for a crash.
            log.exception("restarting worker %s failed", url)
            self._failures[index] += 1
            self._due[index] = self._clock() + self._backoff.delay(self._failures[index])
            return
        self._restarts[url] += 1
        log.warning("worker %s restarted (restart %d)", url, self._restarts[url])

    def _run(self) -> None:
        while not self._stopping.wait(self._poll_s):
            try:
                self.check()
            except Exception:
                # A supervisor thread that died would end self-healing without a word while
                # serving went on: say what failed, and keep watching.
                log.exception("supervising the workers failed; next try in %.0f s", self._poll_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="eldr-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (returns after any restart in progress); the workers keep running."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
