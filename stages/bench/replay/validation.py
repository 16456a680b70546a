"""Simulated against live: a replay's figures beside the live run's, judged by tolerances.

TPOT p50 and p99 must lie within 10% of live, or within the live run-to-run spread of that
policy (max - min over the runs compared, over their mean) when that is larger; distinct
experts per layer per decode step within 5%. ITL and TTFT are shown beside them, not judged,
and so is each policy's live engine pace: how slow the engine ran in that policy's rounds
against the run's median policy, its live steps priced by the replay's cost model. A shared VM
drifts within one bench, and a policy whose rounds fell on a fast or slow stretch shows it here
as plainly as in its TPOT; the rounds' own scatter, simulated against live round by round,
says how much of that no replay can know (``round_scatter``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from stages.bench.metric_registry import REPLAYED
from stages.bench.replay.round_scatter import RoundScatter

Metrics = Mapping[str, Mapping[str, float]]  # policy -> metric key -> value


@dataclass(frozen=True)
class Check:
    sim: float
    live: float
    tolerance: float | None  # the one applied (spread included); None: not judged

    @property
    def ratio(self) -> float:
        return self.sim / self.live if self.live else float("nan")

    @property
    def ok(self) -> bool | None:
        if self.tolerance is None:
            return None
        return math.isfinite(self.ratio) and abs(self.ratio - 1.0) <= self.tolerance + 1e-12


@dataclass(frozen=True)
class Compared:
    """One live run's figures and its replay's."""

    name: str  # short, for legends
    header: str  # what ran, for the table's heading
    live: Metrics
    sim: Metrics
    # Per policy: live step time over the cost model's price of it, over the run's median
    # policy's (> 1: its rounds ran on a slower engine). Empty when the run has no counters.
    engine_pace: Mapping[str, float] = field(default_factory=dict)
    round_scatter: RoundScatter | None = None  # None: fewer than two rounds a policy


@dataclass(frozen=True)
class RunCheck:
    """One live run's policies, simulated against live."""

    name: str
    header: str
    checks: dict[str, dict[str, Check]]  # policy -> metric key -> check
    engine_pace: Mapping[str, float] = field(default_factory=dict)
    round_scatter: RoundScatter | None = None

    def failures(self) -> list[tuple[str, str]]:
        return [
            (policy, key)
            for policy, checks in self.checks.items()
            for key, check in checks.items()
            if check.ok is False
        ]


def live_spread(lives: Sequence[Metrics], policy: str, key: str) -> float:
    """(max - min) / mean of a policy's live figure over the runs (0 for one run)."""
    values = [float(m[policy][key]) for m in lives if policy in m and key in m[policy]]
    values = [v for v in values if math.isfinite(v)]
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def validate(runs: Sequence[Compared]) -> list[RunCheck]:
    """Each run's checks; the live spread is taken over all of them."""
    lives = [r.live for r in runs]
    out = []
    for run in runs:
        live, sim = run.live, run.sim
        checks: dict[str, dict[str, Check]] = {}
        for policy in live:
            if policy not in sim:
                continue
            row = {}
            for metric in REPLAYED:
                tolerance = metric.tolerance
                if tolerance is not None and metric.spread_counts:
                    tolerance = max(tolerance, live_spread(lives, policy, metric.key))
                row[metric.key] = Check(
                    float(sim[policy].get(metric.key, math.nan)),
                    float(live[policy].get(metric.key, math.nan)),
                    tolerance,
                )
            checks[policy] = row
        out.append(RunCheck(run.name, run.header, checks, run.engine_pace, run.round_scatter))
    return out


def _cell(check: Check) -> str:
    mark = {True: " ", False: "!", None: " "}[check.ok]
    return f"{check.sim:.1f}/{check.live:.1f} {check.ratio:.2f}{mark}"


def format_run_check(run: RunCheck) -> str:
    """One row per policy: sim/live and their ratio per metric, ``!`` past its tolerance."""
    width = max([len("policy"), *(len(p) for p in run.checks)])
    cells = {p: [_cell(row[m.key]) for m in REPLAYED] for p, row in run.checks.items()}
    widths = [
        max(len(m.label + " sim/live"), *(len(c[i]) for c in cells.values()))
        for i, m in enumerate(REPLAYED)
    ]
    pace_label = "live engine"
    head = f"{'policy':<{width}}  " + "  ".join(
        f"{m.label + ' sim/live':>{w}}" for m, w in zip(REPLAYED, widths, strict=True)
    ) + (f"  {pace_label}" if run.engine_pace else "")
    lines = [run.header, head + "  verdict", "-" * (len(head) + 9)]
    for policy, row in run.checks.items():
        failed = [m for m in REPLAYED if row[m.key].ok is False]
        verdict = "ok" if not failed else "off: " + ", ".join(
            f"{m.label} {row[m.key].ratio - 1:+.0%} (tol {row[m.key].tolerance:.0%})"
            for m in failed
        )
        lines.append(
            f"{policy:<{width}}  "
            + "  ".join(f"{c:>{w}}" for c, w in zip(cells[policy], widths, strict=True))
            + (f"  {_pace(run.engine_pace.get(policy)):>{len(pace_label)}}"
               if run.engine_pace else "")
            + f"  {verdict}"
        )
    if run.round_scatter is not None:
        lines.append(run.round_scatter.describe())
    return "\n".join(lines)


def _pace(pace: float | None) -> str:
    return "-" if pace is None or not math.isfinite(pace) else f"{(pace - 1) * 100:+.1f}%"


def format_validation(runs: Sequence[RunCheck]) -> str:
    judged = ", ".join(
        f"{m.label} within {m.tolerance:.0%}" + (" or the live spread" if m.spread_counts else "")
        for m in REPLAYED
        if m.tolerance is not None
    )
    failures = sum(len(r.failures()) for r in runs)
    total = sum(
        1 for r in runs for row in r.checks.values() for c in row.values() if c.ok is not None
    )
    verdict = (
        f"validation passed: {total} of {total} checks within tolerance"
        if not failures
        else f"validation failed: {failures} of {total} checks out of tolerance (marked !)"
    )
    pace = ("\nlive engine: how much slower (+) or faster (-) the engine ran in the policy's"
            " rounds than in the run's median policy's (its live steps over the cost model's"
            " price of them); the replay runs every policy on one engine speed"
            if any(r.engine_pace for r in runs) else "")
    return "\n\n".join(
        [*(format_run_check(r) for r in runs),
         f"simulated/live per metric, ratio after; judged: {judged}{pace}\n{verdict}"]
    )


def validation_json(runs: Sequence[RunCheck]) -> dict[str, object]:
    def number(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {
        "metrics": {
            m.key: {"label": m.label, "tolerance": m.tolerance, "spread_counts": m.spread_counts}
            for m in REPLAYED
        },
        "passed": not any(r.failures() for r in runs),
        "runs": [
            {
                "name": r.name,
                "header": r.header,
                "engine_pace": {p: number(v) for p, v in r.engine_pace.items()},
                "round_scatter": None if r.round_scatter is None else (
                    asdict(r.round_scatter) | {"per_policy": r.round_scatter.per_policy}
                ),
                "policies": {
                    policy: {
                        key: {
                            "sim": number(c.sim),
                            "live": number(c.live),
                            "ratio": number(c.ratio),
                            "tolerance": c.tolerance,
                            "ok": c.ok,
                        }
                        for key, c in row.items()
                    }
                    for policy, row in r.checks.items()
                },
            }
            for r in runs
        ],
    }
