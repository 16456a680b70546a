"""The engine-cost probe's passes on disk, the drift between them, and one fit over them all.

One probe pass measures the engine at one moment, and on a shared VM the engine's speed moves:
the same probe batches took up to 20% longer in one demo run than in another, and a run whose
probe ran ~15% slow had every replayed TPOT p50 16-24% above live. A pass before a bench and one
after it bracket the bench: the fit over both sits at the engine's mean speed across it, and the
drift between them says how far a simulation on it can be trusted.

``engine-cost-passes.json`` in a results folder holds every pass: what it measured, which
prompts it sent (a later pass sends others, so none is a prefix-cache hit), and the deployment
it measured (a later pass must measure the same one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import orjson

from stages.bench.cost.engine_cost import (
    EngineCostResult,
    Measurement,
    fit_measurements,
    shared_core_scale,
)
from stages.errors import EldrError
from stages.routing.cost_model import CostSample

PASSES_FILE = "engine-cost-passes.json"
FORMAT = 1
# Past this the bench ran on an engine measurably faster or slower than one pass saw.
DRIFT_WARNING = 0.05


@dataclass(frozen=True)
class ProbePass:
    started: str  # ISO time, for the reader
    workers: tuple[str, ...]
    core_sharing: tuple[int, ...]  # per worker, as measured
    num_layers: int
    measurements: tuple[Measurement, ...]
    prefill_points: tuple[tuple[int, float], ...]
    prompt_ids: tuple[str, ...]
    transfer_points: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, result: EngineCostResult, started: str, workers: Sequence[str],
           core_sharing: Sequence[int]) -> ProbePass:
        return cls(started, tuple(workers), tuple(core_sharing), result.model.num_layers,
                   result.measurements, result.prefill_points, result.prompt_ids,
                   result.transfer_points)

    def to_json(self) -> dict[str, object]:
        return asdict(self)  # orjson writes the tuples as lists

    @classmethod
    def from_json(cls, doc: dict) -> ProbePass:
        # orjson writes NaN (a batch without streamed gaps) as null.
        measurements = tuple(
            Measurement(**{**m, "sample": CostSample(**m["sample"]),
                           "client_step_s": _number(m.get("client_step_s"))})
            for m in doc["measurements"]
        )
        return cls(
            started=str(doc["started"]),
            workers=tuple(doc["workers"]),
            core_sharing=tuple(int(n) for n in doc["core_sharing"]),
            num_layers=int(doc["num_layers"]),
            measurements=measurements,
            prefill_points=tuple((int(t), float(s)) for t, s in doc["prefill_points"]),
            prompt_ids=tuple(doc["prompt_ids"]),
            # Passes saved before the KV hand-off was timed have none.
            transfer_points=tuple((int(t), float(s)) for t, s in doc.get("transfer_points", ())),
        )


def _number(value: object) -> float:
    return math.nan if value is None else float(value)  # type: ignore[arg-type]


def save_passes(path: Path, passes: Sequence[ProbePass]) -> None:
    doc = {"format": FORMAT, "passes": [p.to_json() for p in passes]}
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    tmp.replace(path)  # a pass interrupted mid-write leaves the earlier file whole


def load_passes(path: Path) -> list[ProbePass]:
    if not path.is_file():
        raise EldrError(f"no earlier engine-cost pass in {path.parent} ({path.name} is missing);"
                        " run `eldr bench --engine-cost` first")
    try:
        doc = orjson.loads(path.read_bytes())
        if doc.get("format") != FORMAT:
            raise EldrError(f"{path} is format {doc.get('format')!r}; this eldr reads {FORMAT}")
        return [ProbePass.from_json(p) for p in doc["passes"]]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EldrError(f"{path} is not an engine-cost passes file ({exc}); delete it and"
                        " measure again") from exc


def check_same_deployment(earlier: ProbePass, workers: Sequence[str], num_layers: int) -> None:
    if tuple(workers) != earlier.workers or num_layers != earlier.num_layers:
        raise EldrError(
            f"the earlier pass ({earlier.started}) measured workers {list(earlier.workers)} of a"
            f" {earlier.num_layers}-layer model; this proxy has {list(workers)} and the artifact"
            f" {num_layers} layers: measure afresh without --another-pass"
        )


def excluded_prompts(passes: Sequence[ProbePass]) -> frozenset[str]:
    return frozenset(i for p in passes for i in p.prompt_ids)


def fit_passes(passes: Sequence[ProbePass]) -> EngineCostResult:
    """One cost model over every pass's batches and prefill timings."""
    first = passes[0]
    return fit_measurements(
        [m for p in passes for m in p.measurements],
        [pt for p in passes for pt in p.prefill_points],
        first.num_layers,
        dict(zip(first.workers, first.core_sharing, strict=True)),
        [pt for p in passes for pt in p.transfer_points],
    )


@dataclass(frozen=True)
class Drift:
    """How a later pass ran against an earlier one's fit: its counted steps and its prefill
    times, each as the median ratio to what the earlier pass's fit predicts at the later
    pass's own batches (so different prompts compare)."""

    step: float
    step_range: tuple[float, float]
    prefill: float  # nan when neither pass timed prefill

    def describe(self) -> str:
        lo, hi = self.step_range
        text = (f"decode steps {_signed(self.step)} (batch by batch {_signed(lo)} to"
                f" {_signed(hi)})")
        if math.isfinite(self.prefill):
            text += f", prefill {_signed(self.prefill)}"
        return text

    @property
    def large(self) -> bool:
        # Decode steps only: prefill is timed on one prompt at a time, and the same pass's
        # prompts scatter 10-20% about its own fit.
        return abs(self.step - 1) > DRIFT_WARNING


def _signed(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f}%"


def drift(earlier: ProbePass, later: ProbePass) -> Drift:
    fitted = fit_passes([earlier])
    # The counted forward: the fit's base less the client's overhead, as the steps were timed.
    forward = replace(fitted.model, base_s=fitted.model.base_s - fitted.step_overhead_s)
    scale = shared_core_scale(dict(zip(later.workers, later.core_sharing, strict=True)))
    ratios = np.array([
        m.sample.step_s * scale[m.worker_url]
        / float(forward.step_time(m.sample.batch, m.sample.distinct))
        for m in later.measurements
    ])
    prefill = math.nan
    if later.prefill_points and len({t for t, _ in earlier.prefill_points}) >= 2:
        prefill = float(np.median([s / float(forward.prefill_time(t))
                                   for t, s in later.prefill_points]))
    return Drift(float(np.median(ratios)), (float(ratios.min()), float(ratios.max())), prefill)
