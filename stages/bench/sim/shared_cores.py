"""Decode workers that share CPU cores, as the kernel time-slices them.

``eldr serve`` binds each worker to cores (``stages.serve.cluster.launcher.core_plan``); with fewer
cores than decode workers, several run on one core, each in a scheduling group of its own
(every worker is a session, so an autogroup). How they share depends on what an idle worker
does:

- ``"bound"``: every worker bound to the core keeps its share, busy or idle, so a worker runs
  at ``1/n`` of the core's speed whenever it steps, ``n`` being the workers bound there.
  vLLM's PD workers do this: the NIXL transfer thread of each busy-polls, idle or not (seen
  on CPU: no voluntary context switch, half of a two-worker core while idle).
- ``"busy"``: idle workers sleep; while ``n`` workers bound to one core are mid-step each
  progresses at ``1/n`` (processor sharing), so a step ends later when a neighbour is busy and
  sooner once it goes idle.

A step's work is in seconds of the worker with a core to itself. Workers with a core each never
slow one another. Prefill workers get cores apart from decode ones whenever there are two or
more (``core_plan``), so they are not modelled here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stages.engine import parse_cores
from stages.errors import EldrError

SHARING_MODES = ("bound", "busy")


@dataclass
class _Running:
    left_s: float  # work left, in seconds of the core alone
    since: float  # when ``left_s`` was last brought up to date


@dataclass(frozen=True)
class StepEnd:
    """A (re)scheduled end of ``worker``'s step; only the latest ``version`` holds."""

    worker: int
    at: float
    version: int


class SharedCores:
    """The steps in progress on each core, and when each will end."""

    def __init__(self, core_of: Sequence[int], mode: str = "bound") -> None:
        """``core_of[w]``: the core group of decode worker ``w`` (equal: they share)."""
        if not core_of:
            raise EldrError("need at least one decode worker's core")
        if mode not in SHARING_MODES:
            raise EldrError(f"core sharing must be one of {SHARING_MODES}, got {mode!r}")
        self._core_of = list(core_of)
        self._busy_only = mode == "busy"
        self._bound = {c: self._core_of.count(c) for c in set(core_of)}
        self._running: dict[int, dict[int, _Running]] = {c: {} for c in set(core_of)}
        self._version = [0] * len(core_of)

    def bound(self, worker: int) -> int:
        """Workers bound to ``worker``'s core, it included."""
        return self._bound[self._core_of[worker]]

    # Processor sharing only: the busy workers on ``core`` split it.
    def _advance(self, core: int, t: float) -> None:
        running = self._running[core]
        n = max(len(running), 1)
        for step in running.values():
            step.left_s = max(step.left_s - (t - step.since) / n, 0.0)
            step.since = t

    def _ends(self, core: int, t: float) -> list[StepEnd]:
        n = len(self._running[core])
        out = []
        for w, step in self._running[core].items():
            self._version[w] += 1
            out.append(StepEnd(w, t + step.left_s * n, self._version[w]))
        return out

    def begin(self, worker: int, t: float, work_s: float) -> list[StepEnd]:
        """``worker`` starts a step of ``work_s``: the new end of every step on its core that
        moved (only its own unless idle workers yield their share)."""
        core = self._core_of[worker]
        if not self._busy_only:
            # A fixed share: nothing to track, no step ever moves (the simulator's hot path).
            return [StepEnd(worker, t + work_s * self._bound[core], self._version[worker])]
        if worker in self._running[core]:
            raise AssertionError(f"worker {worker} started a step while mid-step")
        self._advance(core, t)
        self._running[core][worker] = _Running(work_s, t)
        return self._ends(core, t)

    def end(self, worker: int, t: float) -> list[StepEnd]:
        """``worker``'s step is over at ``t``: the new ends of the others on its core (none
        move unless idle workers yield their share)."""
        if not self._busy_only:
            return []
        core = self._core_of[worker]
        self._advance(core, t)
        del self._running[core][worker]
        return self._ends(core, t)

    def current(self, end: StepEnd) -> bool:
        """Whether ``end`` is still the worker's scheduled end (not superseded)."""
        return end.version == self._version[end.worker]


def core_groups(bindings: Sequence[str | None]) -> tuple[int, ...]:
    """Core group per worker from their core bindings (``"1"``, ``"2-3"``; None: unbound, a
    core of its own). Equal bindings share; bindings that overlap without being equal are
    refused, since one worker would share only part of its cores."""
    groups: dict[str, int] = {}
    sets: dict[str, set[int]] = {}
    out = []
    for i, text in enumerate(bindings):
        if text is None:
            out.append(-1 - i)
            continue
        cores = set(parse_cores(text))
        for other, seen in sets.items():
            if other != text and cores & seen:
                raise EldrError(
                    f"core sets {other!r} and {text!r} overlap without being equal; the"
                    " shared-core model needs workers to share all of their cores or none"
                )
        sets[text] = cores
        out.append(groups.setdefault(text, len(groups)))
    return tuple(out)
