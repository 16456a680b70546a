"""`eldr fit`'s locality dial: where the fitted data sits on the dial, and what a simulated
cluster gives there, so "will it help" comes with a TPOT figure and its interval.

The dial is a dataset blended from its own decode (s = 0) to another request's (s = 1: the
prefill predicts nothing; ``locality_blend``). The fitted data's cross-fitted gain at its
smallest estimated batch size (the fit's verdict rests on it) is placed where the blended
dataset's gain falls to it (``locality_sweep.place``), each blended row labelled by the same
out-of-fold clusters (``agreement.labelled_agreement``): a held-out fifth, which `eldr bench
--simulate`'s dial reads, is too few requests per cluster at the k users fit. Then the cluster
`eldr bench --simulate` simulates by default (8P16D, the fit's --cost) runs eldr-union and the
four load balancers there, at half its capacity (as the demo's dial), a few short runs on
different seeds: the TPOT ratio's interval is over those runs (Student's t), not assumed.

The dataset the dial is built on: the one `eldr bench --simulate` sweeps by default
($ELDR_HOME/signatures.zarr, the bundled prompts' capture), or --dial-data; the fit's own data
when that is the same data, is missing, or is another model's (gains of different models do
not compare). On its own data the fit sits at s = 0 by construction, and the figure is its
own simulated cluster. eldr-union needs no centroids, so every row is simulated, not only the
held-out ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from stages import paths
from stages.bench.report import BASELINES, ratios_to_best
from stages.bench.sim.agreement import Agreement, first_estimated, labelled_agreement
from stages.bench.sim.capacity import cluster_capacity
from stages.bench.sim.locality_sweep import DataMark, agreement_curve, curve_grid, place
from stages.bench.sim.simulate_run import SMALL_DATASET
from stages.bench.sim.simulator import SimConfig, simulate
from stages.errors import EldrError
from stages.fit.dial import DialInput, DialRunner
from stages.fit.pipeline import FitConfig, cross_fit, fit_clustering, split_requests
from stages.routing.cost_model import CostModel
from stages.signature.dataset import SignatureArrays, SignatureDataset

POLICY = "eldr-union"  # the policy the README starts users on; it needs no artifact
YOURS = "your data"


@dataclass(frozen=True)
class DialSettings:
    """The simulated cluster and how long it runs: a few seconds on two cores."""

    prefill: int = 8  # `eldr bench --simulate`'s default cluster
    decode: int = 16
    load: float = 0.5  # of the cluster's capacity, as the demo's dial runs it
    requests: int = 400  # arrivals per run
    seeds: int = 5  # runs, each its own arrivals, rows and blend partners
    # Every answer this long, as the paper's runs (512 with ignore_eos) and the README's
    # simulated figures: a capture's answers are as short as its --max-tokens (32 by default),
    # which leaves decode batches nearly empty and locality nothing to decide.
    output_tokens: int = 512
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.seeds < 2:
            raise EldrError(f"an interval over seeds needs at least 2 of them, got {self.seeds}")
        if not 0.0 < self.load or min(self.requests, self.output_tokens) < 1:
            raise EldrError("the dial's load, requests and output tokens must be positive")


@dataclass(frozen=True)
class DialData:
    """The dataset the dial is built on; ``path`` None: the fit's own."""

    path: Path | None
    note: str = ""  # why the dial fell back on the fit's own data, if it did


def choose_dial_data(fit_data: Path, dial_data: Path | None) -> DialData:
    """The dial's dataset, before the fit starts: a --dial-data that is missing or of another
    model is the user's mistake; the default one merely falls back on the fit's data."""
    path = dial_data or paths.default_dataset()
    if path.resolve() == fit_data.resolve():
        return DialData(None)
    if dial_data is None and not path.exists():
        return DialData(None)
    dial = SignatureDataset.open(path)
    fitted = SignatureDataset.open(fit_data)
    if dial.identity == fitted.identity:
        return DialData(path)
    why = (f"{path} holds {dial.identity.describe()} signatures and the fit's data"
           f" {fitted.identity.describe()}: gains of different models do not compare")
    if dial_data is not None:
        raise EldrError(f"--dial-data: {why}; pass a dataset of the fit's model")
    return DialData(None, why)


def fit_dial(
    data: DialData, settings: DialSettings = DialSettings(),
    progress: Callable[[str], None] = lambda _line: None,
) -> DialRunner:
    """The dial `eldr fit` runs on its dataset's arrays (``stages.fit.fit_dataset``)."""
    return partial(build_dial, data=data, settings=settings, progress=progress)


def build_dial(
    arrays: SignatureArrays, fit: DialInput, *, data: DialData, settings: DialSettings,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """The artifact's ``dial`` metric for a fit of ``arrays`` (``stages.fit.dial``)."""
    found = first_estimated(fit.expected_gain)
    if found is None:
        return {"skipped": "the fit estimated its gain at no batch size (see the verdict)"}
    batch, value = found
    config, top_k = fit.config, fit.identity.top_k
    other = None if data.path is None else SignatureDataset.open(data.path)
    if other is None or other.content_hash() == fit.dataset_hash:
        mark = DataMark(YOURS, value, 0.0, data.note)
        return _dial(None, arrays, batch, mark, [], fit, settings, progress)
    try:
        dial_arrays = other.read()
        progress(f"dial: fitting k={config.k} on {other.path} as on your data (cross-fit)")
        labels = _cross_fit_labels(dial_arrays, config)
    except EldrError as exc:
        return {"skipped": f"cannot fit the dial's data {other.path}: {exc}"}
    rows = np.arange(len(dial_arrays))

    def measure(blended: SignatureArrays) -> Agreement | None:
        return labelled_agreement(blended, rows, labels, config.k, top_k, batch, config.seed)

    curve = agreement_curve(dial_arrays, measure, curve_grid(), config.seed, top_k)
    placed = place(curve, value, YOURS)
    if placed is None:
        return {"skipped": f"the dial's data {other.path} estimates no gain at batch {batch}"
                           f" with k={config.k}: too few requests per cluster"}
    return _dial(other.path, dial_arrays, batch, placed, curve, fit, settings, progress)


def _dial(
    path: Path | None, arrays: SignatureArrays, batch: int, mark: DataMark,
    curve: list[tuple[float, Agreement]], fit: DialInput, settings: DialSettings,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """The stored answer: the mark on the dial of ``arrays`` (at ``path``; None: the fit's
    own) and the simulated cluster there."""
    return {
        "data": YOURS if path is None else str(path),
        "own_data": path is None,
        "batch_size": batch,
        "agreement": mark.agreement,
        "strength": mark.strength,
        "note": mark.note,
        "curve": [{"strength": s, "reduction": a.reduction, "interval": list(a.interval)}
                  for s, a in curve],
        "simulation": simulate_at(arrays, mark.strength, fit.cost, fit.identity.top_k,
                                  fit.config.seed, settings, progress),
    }


def _cross_fit_labels(arrays: SignatureArrays, config: FitConfig) -> np.ndarray:
    """Every row's out-of-fold cluster, as `eldr fit` on that dataset labels them."""
    if len(arrays) < 2 * config.k:
        raise EldrError(f"{len(arrays)} signatures cannot make {config.k} clusters of two")
    prefill, decode = arrays.prefill_counts, arrays.decode_counts
    train, _ = split_requests(len(arrays), config.holdout_fraction, config.seed)
    artifact = fit_clustering(prefill[train], decode[train], config)
    return cross_fit(prefill, decode, artifact, config).labels


def simulate_at(
    arrays: SignatureArrays, strength: float, cost: object, top_k: int, seed: int,
    settings: DialSettings, progress: Callable[[str], None],
) -> dict[str, Any]:
    """eldr-union's TPOT p50 and p99 over the best load balancer's, on ``arrays`` blended at
    ``strength``, over ``settings.seeds`` runs."""
    if not isinstance(cost, CostModel):
        return {"skipped": "no step-time model for this model (pass --cost cpu or a fitted"
                           " JSON)"}
    base = SimConfig(cost=cost, num_prefill=settings.prefill, num_decode=settings.decode,
                     policies=(POLICY, *BASELINES), output_tokens=settings.output_tokens,
                     max_output_tokens=settings.output_tokens, locality_blend=strength)
    capacity = cluster_capacity(
        cost, arrays, top_k, num_prefill=base.num_prefill, num_decode=base.num_decode,
        max_batch=base.max_batch, output_tokens=base.output_tokens,
        max_output_tokens=base.max_output_tokens,
        first_token_from_prefill=base.first_token_from_prefill)
    rate = settings.load * capacity.rps
    duration = settings.requests / rate
    seeds = [seed + i for i in range(settings.seeds)]
    cluster = f"{settings.prefill}P{settings.decode}D"
    progress(f"dial: simulating {cluster} at s = {strength:.2f}, {rate:.3g} req/s"
             f" ({settings.load:.0%} of capacity), {len(seeds)} seeds")
    ratios = []
    for run_seed in seeds:
        run = replace(base, request_rate=rate, duration_s=duration, seed=run_seed)
        results = simulate(run, arrays, None, top_k=top_k)
        ratios.append(ratios_to_best({n: r.metrics for n, r in results.items()})[POLICY])
    figures = {key: seed_interval([r[key] for r in ratios], settings.confidence)
               for key in ("median_tpot_ms", "p99_tpot_ms")}
    if not all(math.isfinite(v) for f in figures.values() for v in f["per_seed"]):
        return {"skipped": "a simulated run measured no TPOT for a load balancer"}
    out: dict[str, Any] = {
        "cluster": cluster, "cost_model": cost.name, "load": settings.load,
        "request_rate": rate, "duration_s": duration, "requests": settings.requests,
        "output_tokens": settings.output_tokens,
        "distinct_requests": len(arrays), "seeds": seeds, "policy": POLICY,
        "balancers": list(BASELINES), "confidence": settings.confidence,
        **{f"{key}_over_best_balancer": figure for key, figure in figures.items()},
    }
    if len(arrays) < SMALL_DATASET:
        out["warning"] = (f"only {len(arrays)} distinct requests: repeats share their experts"
                          " exactly, which flatters eldr-union")
    return out


def seed_interval(values: list[float], confidence: float) -> dict[str, Any]:
    """Mean of per-seed figures and its Student-t interval (the runs are independent)."""
    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    half = float(stats.t.ppf(0.5 + confidence / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
    return {"mean": mean, "interval": [mean - half, mean + half], "per_seed": v.tolist()}
