"""PNG plots of a comparison (matplotlib's object API: no pyplot, no global figure state)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stages.bench.results import ComparisonResult, PolicyResult, rate_label


def _save(fig: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)  # Agg renders PNG without a display
    fig.savefig(path, dpi=120)
    return path


# Policies whose curves coincide (rr and jsq at low load) stay visible: each gets its own dash.
_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


def plot_tpot_distribution(
    results: Mapping[str, PolicyResult], path: Path, title: str = ""
) -> Path:
    """Empirical CDF of per-request TPOT for each policy (tails at the top right)."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, result) in enumerate(results.items()):
        tpot = np.sort(result.table.tpot_s()) * 1000.0
        if tpot.size == 0:
            continue
        ax.plot(tpot, np.arange(1, tpot.size + 1) / tpot.size, drawstyle="steps-post",
                linestyle=_STYLES[i % len(_STYLES)], linewidth=1.6,
                label=f"{name} ({tpot.size} requests)")
    ax.set_xlabel("TPOT (ms per output token)")
    ax.set_ylabel("cumulative fraction of requests (CDF)")
    ax.set_title(title or "TPOT distribution")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_rate_sweep(sweep: Sequence[ComparisonResult], path: Path, title: str = "") -> Path:
    """TPOT p50, TPOT p99 and distinct experts per layer against request rate."""
    panels = (
        ("median_tpot_ms", "TPOT p50 (ms)"),
        ("p99_tpot_ms", "TPOT p99 (ms)"),
        ("distinct_experts_per_layer", "distinct experts / layer / step"),
    )
    ordered = sorted(sweep, key=lambda c: c.request_rate)
    finite = [c for c in ordered if math.isfinite(c.request_rate)]
    policies = list(dict.fromkeys(p for c in finite for p in c.policies))
    fig = Figure(figsize=(13, 4), layout="constrained")
    axes = fig.subplots(1, len(panels))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for i, name in enumerate(policies):
            points = [
                (c.request_rate, c.results[name].metrics.get(key, float("nan")))
                for c in finite
                if name in c.results
            ]
            xs, ys = zip(*points, strict=True) if points else ((), ())
            ax.plot(xs, ys, marker="o", linestyle=_STYLES[i % len(_STYLES)], label=name)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title or "policies against request rate")
    return _save(fig, path)


def write_plots(
    sweep: Sequence[ComparisonResult], result_dir: Path, source: str, prefix: str = ""
) -> list[Path]:
    """One TPOT distribution per rate; the rate sweep when two or more finite rates ran.

    ``source`` says where the numbers come from (live proxy or simulated cluster, its shape);
    it heads every title, so a live plot is never mistaken for a simulated one.
    """
    result_dir = Path(result_dir)
    paths = [
        plot_tpot_distribution(
            c.results,
            result_dir / f"{prefix}tpot-{rate_label(c.request_rate)}qps.png",
            title=f"{source}\nTPOT at {rate_label(c.request_rate)} req/s",
        )
        for c in sweep
    ]
    if sum(math.isfinite(c.request_rate) for c in sweep) >= 2:
        paths.append(plot_rate_sweep(sweep, result_dir / f"{prefix}rate-sweep.png",
                                     title=f"{source}: policies against request rate"))
    return paths
