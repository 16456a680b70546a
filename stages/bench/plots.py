"""PNG plots of a comparison (matplotlib's object API: no pyplot, no global figure state)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stages.bench.metric_registry import RATE_PANELS
from stages.bench.results import ComparisonResult, PolicyResult, rate_label


def save_figure(fig: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)  # Agg renders PNG without a display
    fig.savefig(path, dpi=120)
    return path


# Policies whose curves coincide (rr, jsq and p2c often do) stay visible: each gets its own
# dash and its own hollow marker, a size smaller than the one before, so markers drawn on one
# point nest instead of hiding each other.
_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
_MARKERS = ("o", "s", "^", "v", "D", "P", "X")


def series_style(i: int) -> dict[str, object]:
    return {
        "linestyle": _STYLES[i % len(_STYLES)],
        "marker": _MARKERS[i % len(_MARKERS)],
        "markersize": 10.0 - 0.8 * (i % len(_MARKERS)),
        "markerfacecolor": "none",
        "markeredgewidth": 1.4,
        "linewidth": 1.4,
    }


def plot_tpot_distribution(
    results: Mapping[str, PolicyResult], path: Path, title: str = ""
) -> Path:
    """Empirical CDF of per-request TPOT for each policy (tails at the top right)."""
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    tpots = {name: np.sort(r.table.tpot_s()) * 1000.0 for name, r in results.items()}
    # Counts in the legend only when they differ (failed requests); the title has the rest.
    counted = len({t.size for t in tpots.values()}) > 1
    for i, (name, tpot) in enumerate(tpots.items()):
        if tpot.size == 0:
            continue
        # A marker every eighth of the requests, at offsets that differ per policy.
        every = max(1, tpot.size // 8)
        ax.plot(tpot, np.arange(1, tpot.size + 1) / tpot.size, drawstyle="steps-post",
                markevery=(i * every // len(tpots), every),
                label=f"{name} ({tpot.size} requests)" if counted else name, **series_style(i))
    ax.set_xlabel("TPOT (ms per output token)")
    ax.set_ylabel("cumulative fraction of requests (CDF)")
    ax.set_title(title or "TPOT distribution")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_rate_sweep(sweep: Sequence[ComparisonResult], path: Path, title: str = "") -> Path:
    """TPOT p50, TPOT p99 and distinct experts per layer against request rate."""
    panels = [(m.key, m.axis) for m in RATE_PANELS]
    ordered = sorted(sweep, key=lambda c: c.request_rate)
    finite = [c for c in ordered if math.isfinite(c.request_rate)]
    policies = list(dict.fromkeys(p for c in finite for p in c.policies))
    fig = Figure(figsize=(14, 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for i, name in enumerate(policies):
            points = [
                (c.request_rate, c.results[name].metrics.get(key, float("nan")))
                for c in finite
                if name in c.results
            ]
            xs, ys = zip(*points, strict=True) if points else ((), ())
            ax.plot(xs, ys, label=name, **series_style(i))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title or "policies against request rate")
    return save_figure(fig, path)


def _requests(comparison: ComparisonResult) -> str:
    counts = sorted({len(r.table) for r in comparison.results.values()})
    span = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{span} requests per policy"


def write_plots(
    sweep: Sequence[ComparisonResult], result_dir: Path, source: str, prefix: str = ""
) -> list[Path]:
    """One TPOT distribution per rate; the rate sweep when two or more finite rates ran.

    ``source`` says where the numbers come from (live or simulated, the cluster's shape, the
    cost model); it heads every title, with the request counts, so a live plot is never
    mistaken for a simulated one.
    """
    result_dir = Path(result_dir)
    paths = [
        plot_tpot_distribution(
            c.results,
            result_dir / f"{prefix}tpot-{rate_label(c.request_rate)}qps.png",
            title=f"{source}\nTPOT at {rate_label(c.request_rate)} req/s, {_requests(c)}",
        )
        for c in sweep
    ]
    finite = sorted((c for c in sweep if math.isfinite(c.request_rate)),
                    key=lambda c: c.request_rate)
    if len(finite) >= 2:
        counts = ", ".join(
            f"{len(next(iter(c.results.values())).table)} at {rate_label(c.request_rate)}"
            for c in finite
        )
        paths.append(plot_rate_sweep(
            sweep, result_dir / f"{prefix}rate-sweep.png",
            title=f"{source}: policies against request rate\nrequests per policy: {counts}"
            " req/s",
        ))
    return paths
