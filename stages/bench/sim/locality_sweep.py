"""The locality dial swept: every policy's TPOT against the best load balancer, from the
dataset's own locality (s = 0) to none (s = 1), and where the user's data sits on it.

At each strength ``s`` the simulator runs every policy on the dataset blended at ``s``
(``locality_blend``) with the same arrivals. A policy's ratio is its TPOT p50 (p99) over the
best load balancer's at that ``s`` (``report.ratios_to_best``).

The mark: the prefill-to-decode agreement (``agreement``: `eldr fit`'s held-out per-step gain
at one batch size, with the simulation's artifact) of the blended dataset falls from the
dataset's own value at s = 0 to about 0 at s = 1. It is computed at every swept ``s`` and on
a finer grid; the mark sits where that curve first falls to the agreement of the data the user
points to (the gain the user's `eldr fit` stored; by default the simulation's own artifact),
linearly interpolated between grid points. Data with more agreement than s = 0 is marked at 0,
with less than s = 1 at 1, each with a note.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from stages.bench.metric_registry import OVER_BEST
from stages.bench.report import BASELINES, best_baseline, ratios_to_best
from stages.bench.results import ComparisonResult
from stages.bench.sim.agreement import Agreement, first_estimated, held_out_agreement, held_out_rows
from stages.bench.sim.locality_blend import blend_decode, check_strength
from stages.bench.sim.sim_workload import RoutingArtifact
from stages.bench.sim.simulator import SimConfig, simulate
from stages.errors import EldrError
from stages.signature.dataset import SignatureArrays

if TYPE_CHECKING:
    from stages.fit.artifact import Artifact

# The agreement curve's grid, besides the swept strengths: it is cheap (no simulation).
CURVE_STEP = 0.05

AGREEMENT_DEFINITION = (
    "eldr fit's expected per-step gain on held-out requests at one decode batch size, as a"
    " reduction: 1 - distinct experts per layer of a same-cluster batch / of a random batch"
    " (nearest centroid; exact means over every batch; bootstrap interval); 0 = the prefill"
    " predicts nothing"
)
# Agreements this close are one value (a stored gain read back against a recomputed one).
_SAME = 1e-9


@dataclass(frozen=True)
class Gauge:
    """What places data on the dial: the simulated dataset's held-out rows, the batch size of
    the gain, and the agreement of the data to mark."""

    rows: np.ndarray
    batch: int
    source: str  # whose agreement ``value`` is
    value: float


@dataclass(frozen=True)
class DataMark:
    source: str
    agreement: float
    strength: float  # where the dial's agreement curve meets it
    note: str = ""


@dataclass(frozen=True)
class LocalitySweep:
    strengths: tuple[float, ...]
    comparisons: tuple[ComparisonResult, ...]  # one per strength, same rate
    # (strength, agreement of the blended dataset) on the swept strengths and a finer grid,
    # sorted; empty without a gauge, and only where the gain was estimable.
    curve: tuple[tuple[float, Agreement], ...] = ()
    batch: int | None = None
    mark: DataMark | None = None

    @property
    def request_rate(self) -> float:
        return self.comparisons[0].request_rate

    @property
    def policies(self) -> tuple[str, ...]:
        return self.comparisons[0].policies

    def ratios(self, key: str) -> dict[str, list[float]]:
        """policy -> its ``key`` over the best load balancer's, per strength."""
        per_point = [ratios_to_best(c.metrics()) for c in self.comparisons]
        return {p: [r[p][key] for r in per_point] for p in self.policies}


def parse_strengths(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise EldrError(
            f"--locality-blend takes numbers in [0, 1], comma separated: {text}"
        ) from exc
    if not values:
        raise EldrError("--locality-blend needs at least one strength")
    return [check_strength(v) for v in values]


def locality_gauge(
    artifact: Artifact,
    dataset_hash: str,
    num_rows: int,
    reference: Artifact,
    source: str,
) -> Gauge | None:
    """The gauge of a simulation on a dataset (its ``content_hash`` and size) with
    ``artifact``, marking the gain ``reference`` (an `eldr fit` artifact, the same or the
    user's) stored; None when that fit estimated no batch size."""
    # The held-out estimate with the artifact's centroids, as the dial measures its points
    # (an artifact from before the cross-fit has it as its expected gain).
    metrics = reference.metrics
    found = first_estimated(metrics.get("holdout_gain", metrics.get("expected_gain", {})))
    if found is None:
        return None
    rows = held_out_rows(artifact.params, artifact.dataset_hash, dataset_hash, num_rows)
    return Gauge(rows=rows, batch=found[0], source=source, value=found[1])


# How a dial measures the agreement of its dataset blended at one strength: None where the gain
# is not estimable there.
Measure = Callable[[SignatureArrays], Agreement | None]


def agreement_curve(
    arrays: SignatureArrays,
    measure: Measure,
    strengths: Sequence[float],
    seed: int,
    top_k: int,
) -> list[tuple[float, Agreement]]:
    """(strength, ``measure`` of the dataset blended at it), sorted by strength; strengths
    where the gain is not estimable are left out."""
    curve = []
    for s in sorted(set(strengths)):
        found = measure(blend_decode(arrays, s, seed, top_k))
        if found is not None:
            curve.append((s, found))
    return curve


def curve_grid(extra: Sequence[float] = ()) -> list[float]:
    """The agreement curve's strengths: every ``CURVE_STEP`` from 0 to 1, and ``extra``."""
    return [*np.round(np.arange(0.0, 1.0 + CURVE_STEP / 2, CURVE_STEP), 6).tolist(), *extra]


def place(
    curve: Sequence[tuple[float, Agreement]], value: float, source: str
) -> DataMark | None:
    """``source``'s data, of agreement ``value``, marked where ``curve`` falls to it; None on
    an empty curve."""
    if not curve:
        return None
    strength, note = locate([(s, a.reduction) for s, a in curve], value)
    return DataMark(source, value, strength, note)


def locate(curve: Sequence[tuple[float, float]], value: float) -> tuple[float, str]:
    """The strength where ``curve`` (sorted by strength, falling) first falls to ``value``."""
    (s0, a0), *rest = curve
    if value > a0 + _SAME:
        return s0, f"more agreement than the simulated dataset's own ({a0:.3f}): s = {s0:g} or less"
    prev_s, prev_a = s0, a0
    for s, a in rest:
        if a <= value + _SAME:
            if prev_a - a <= _SAME:
                return prev_s, ""
            share = min(max((prev_a - value) / (prev_a - a), 0.0), 1.0)
            return prev_s + share * (s - prev_s), ""
        prev_s, prev_a = s, a
    return prev_s, f"less agreement than the dial's end ({prev_a:.3f}): no locality at all"


def run_locality_sweep(
    config: SimConfig,
    arrays: SignatureArrays,
    artifact: RoutingArtifact | None,
    strengths: Sequence[float],
    *,
    top_k: int,
    gauge: Gauge | None = None,
    simulated: SignatureArrays | None = None,
) -> LocalitySweep:
    """``simulate`` at each strength (the rest of ``config`` unchanged) on ``simulated`` (by
    default ``arrays``; the CLI passes the rows the centroids did not see), and with a
    ``gauge`` (which needs the artifact) the agreement curve of ``arrays`` and the data
    mark."""
    swept = tuple(sorted({check_strength(s) for s in strengths}))
    if len(swept) < 2:
        raise EldrError("a locality sweep needs at least two strengths, e.g. 0,0.5,1")
    comparisons = tuple(
        ComparisonResult(
            config.request_rate,
            simulate(replace(config, locality_blend=s),
                     arrays if simulated is None else simulated, artifact, top_k=top_k),
            {"locality_blend": s},
        )
        for s in swept
    )
    if gauge is None or artifact is None:
        return LocalitySweep(swept, comparisons)

    def measure(blended: SignatureArrays) -> Agreement | None:
        return held_out_agreement(blended, gauge.rows, artifact, top_k, gauge.batch, config.seed)

    curve = agreement_curve(arrays, measure, curve_grid(swept), config.seed, top_k)
    return LocalitySweep(swept, comparisons, tuple(curve), gauge.batch,
                         place(curve, gauge.value, gauge.source))


def sweep_json(sweep: LocalitySweep, info: dict[str, Any]) -> dict[str, Any]:
    """The numbers behind the dial's plot (NaN as None)."""
    policies: dict[str, Any] = {}
    ratios = {key: sweep.ratios(key) for key in (m.key for m in OVER_BEST)}
    for name in sweep.policies:
        entry: dict[str, Any] = {}
        for key in (m.key for m in OVER_BEST):
            entry[key] = [_num(c.results[name].metrics.get(key)) for c in sweep.comparisons]
            entry[f"{key}_over_best_balancer"] = [_num(v) for v in ratios[key][name]]
        entry["distinct_experts_per_layer"] = [
            _num(c.results[name].metrics.get("distinct_experts_per_layer"))
            for c in sweep.comparisons
        ]
        policies[name] = entry
    best = {
        key: [b[0] if (b := best_baseline(c.metrics(), key)) else None for c in sweep.comparisons]
        for key in (m.key for m in OVER_BEST)
    }
    return {
        **info,
        "request_rate": sweep.request_rate,
        "requests_per_policy": requests_per_policy(sweep.comparisons[0]),
        "strengths": list(sweep.strengths),
        "balancers": list(BASELINES),
        "best_balancer": best,
        "policies": policies,
        "agreement": {
            "definition": AGREEMENT_DEFINITION,
            "batch_size": sweep.batch,
            "curve": [
                {"strength": s, "reduction": a.reduction, "interval": list(a.interval),
                 "swept": s in sweep.strengths}
                for s, a in sweep.curve
            ],
        },
        "data_mark": None if sweep.mark is None else {
            "source": sweep.mark.source,
            "agreement": sweep.mark.agreement,
            "strength": sweep.mark.strength,
            "note": sweep.mark.note,
        },
    }


def requests_per_policy(comparison: ComparisonResult) -> int:
    return max(len(r.table) for r in comparison.results.values())


def format_dial(sweep: LocalitySweep) -> str:
    """One row per policy: TPOT p50 / p99 over the best load balancer at each strength."""
    head = ["policy", *(f"s={s:g}" for s in sweep.strengths)]
    p50, p99 = (sweep.ratios(key) for key in (m.key for m in OVER_BEST))
    rows = [head]
    if sweep.curve:
        at = dict(sweep.curve)
        rows.append([f"agreement (B={sweep.batch})",
                     *(f"{at[s].reduction:.3f}" if s in at else "-" for s in sweep.strengths)])
    rows += [[p, *(f"{a:.2f} / {b:.2f}" for a, b in zip(p50[p], p99[p], strict=True))]
             for p in sweep.policies]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("cells: TPOT p50 / p99 over the best load balancer at that strength")
    if sweep.curve:
        lines.append(f"agreement: {AGREEMENT_DEFINITION}")
    mark = sweep.mark
    if mark is None:
        lines.append("no data mark: it needs a fitted artifact whose held-out gain is estimable")
    else:
        lines.append(
            f"your data ({mark.source}): agreement {mark.agreement:.3f}, at s ="
            f" {mark.strength:.2f}" + (f" ({mark.note})" if mark.note else "")
        )
    return "\n".join(lines)


def _num(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(float(value)) else float(value)
