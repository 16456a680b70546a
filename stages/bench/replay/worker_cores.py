"""Where a live cluster's workers ran: their core bindings, as ``eldr serve`` made them.

Results do not record the binding; on the machine that served the run it is the launcher's
plan (``stages.serve.cluster.launcher.core_plan``) over this process's cores, unless the user gives
it (``--worker-cores``, as ``eldr serve`` takes it). On a GPU build workers are not bound.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from stages.bench.sim.shared_cores import core_groups
from stages.engine import on_cpu, parse_cores
from stages.errors import EldrError
from stages.serve.cluster.launcher import core_plan


@dataclass(frozen=True)
class CorePlan:
    """Where the live workers ran: core bindings, prefill workers first."""

    bindings: tuple[str | None, ...]
    num_prefill: int

    @property
    def decode_groups(self) -> tuple[int, ...]:
        return core_groups(self.bindings[self.num_prefill :])

    def prefill_shares_decode_cores(self) -> bool:
        def cores(text: str | None) -> set[int]:
            return set(parse_cores(text)) if text else set()

        prefill = set().union(*(cores(b) for b in self.bindings[: self.num_prefill]))
        decode = set().union(*(cores(b) for b in self.bindings[self.num_prefill :]))
        return bool(prefill & decode)

    def describe(self) -> str:
        roles = ["P"] * self.num_prefill + ["D"] * (len(self.bindings) - self.num_prefill)
        return ", ".join(
            f"{role}{i}: core {b}" if b else f"{role}{i}: unbound"
            for i, (role, b) in enumerate(zip(roles, self.bindings, strict=True))
        )


def live_core_plan(
    num_prefill: int, num_decode: int, worker_cores: Sequence[str] | None = None
) -> CorePlan:
    """The given per-worker cores (prefill workers first), else ``eldr serve``'s plan on this
    machine's cores."""
    n = num_prefill + num_decode
    if worker_cores is not None:
        if len(worker_cores) != n:
            raise EldrError(
                f"--worker-cores lists {len(worker_cores)} core sets for the run's {n} workers"
                " (prefill workers first, then decode workers)"
            )
        for text in worker_cores:
            try:
                parse_cores(text)
            except ValueError:
                raise EldrError(
                    f"--worker-cores: {text!r} is not a core list like 0, 2-3 or 0,2"
                ) from None
        return CorePlan(tuple(worker_cores), num_prefill)
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    cores = sorted(os.sched_getaffinity(0)) if on_cpu() else []
    return CorePlan(tuple(core_plan(roles, cores)), num_prefill)
