"""PNG plots of a comparison (matplotlib's object API: no pyplot, no global figure state)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stages.bench.metric_registry import OVER_BEST, RATE_PANELS, REPLAYED
from stages.bench.replay.validation import RunCheck
from stages.bench.results import ComparisonResult, PolicyResult, rate_label

if TYPE_CHECKING:
    from stages.bench.sim.locality_sweep import LocalitySweep


def _save(fig: Figure, path: Path) -> Path:
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


def _style(i: int) -> dict[str, object]:
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
                label=f"{name} ({tpot.size} requests)" if counted else name, **_style(i))
    ax.set_xlabel("TPOT (ms per output token)")
    ax.set_ylabel("cumulative fraction of requests (CDF)")
    ax.set_title(title or "TPOT distribution")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


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
            ax.plot(xs, ys, label=name, **_style(i))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title or "policies against request rate")
    return _save(fig, path)


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


def plot_locality_dial(sweep: LocalitySweep, path: Path, title: str = "") -> Path:
    """TPOT p50 and p99 over the best load balancer against the locality dial and, when the
    sweep has one, the agreement curve that places the user's data on it (a vertical line in
    every panel, named in the legend under the figure)."""
    panels = 3 if sweep.curve else 2
    fig = Figure(figsize=(4.7 * panels, 4.6), layout="constrained")
    axes = list(fig.subplots(1, panels))
    xs = list(sweep.strengths)
    for ax, (key, label) in zip(axes[:2], ((m.key, m.label) for m in OVER_BEST), strict=True):
        for i, (name, ys) in enumerate(sweep.ratios(key).items()):
            ax.plot(xs, ys, label=name, **_style(i))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"{label} / best load balancer's")
        ax.set_title(f"{label} over the best load balancer at each s", fontsize=9)
    mark = sweep.mark
    if sweep.curve:
        ax_a = axes[2]
        strengths = np.array([s for s, _ in sweep.curve])
        value = np.array([a.reduction for _, a in sweep.curve])
        lo, hi = (np.array([a.interval[j] for _, a in sweep.curve]) for j in (0, 1))
        ax_a.fill_between(strengths, lo, hi, color="tab:blue", alpha=0.2,
                          label="95% interval")
        ax_a.plot(strengths, value, color="tab:blue", label="simulated data, blended")
        swept = np.isin(strengths, xs)
        ax_a.plot(strengths[swept], value[swept], "o", color="tab:blue",
                  label="swept strengths")
        ax_a.axhline(0.0, color="black", linewidth=0.8)
        if mark is not None:
            ax_a.axhline(mark.agreement, color="tab:red", linewidth=1.0, linestyle=":",
                         label=f"your data: {mark.agreement:.3f}")
            ax_a.set_title(f"your data: {mark.source}", fontsize=9)
        ax_a.set_ylabel(f"held-out distinct-expert reduction, batch {sweep.batch}")
        ax_a.legend(fontsize=8, loc="upper right")
    for ax in axes:
        ax.set_xlabel("locality blend s (0 = own decode, 1 = another request's)")
        ax.set_xlim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if mark is not None:
        for ax in axes:
            line = ax.axvline(mark.strength, color="tab:red", linewidth=1.2, linestyle="--")
        handles.append(line)
        labels.append(f"your data: s = {mark.strength:.2f}")
    # One legend under the figure: inside, the curves fill every corner of the ratio panels.
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title or "policies against the locality dial")
    return _save(fig, path)


def plot_validation(runs: Sequence[RunCheck], path: Path, title: str = "") -> Path:
    """Simulated over live per policy, a panel per judged metric: one marker per live run
    (filled past its tolerance), the base tolerance shaded around 1."""
    judged = [m for m in REPLAYED if m.tolerance is not None]
    policies = list(dict.fromkeys(p for r in runs for p in r.checks))
    fig = Figure(figsize=(4.6 * len(judged), 4.4), layout="constrained")
    axes = fig.subplots(1, len(judged))
    xs = np.arange(len(policies))
    for ax, metric in zip(axes, judged, strict=True):
        assert metric.tolerance is not None
        ax.axhspan(1 - metric.tolerance, 1 + metric.tolerance, color="tab:green", alpha=0.15)
        ax.axhline(1.0, color="black", linewidth=0.8)
        for i, run in enumerate(runs):
            style = _style(i)
            for x, policy in zip(xs, policies, strict=True):
                check = run.checks.get(policy, {}).get(metric.key)
                if check is None:
                    continue
                ax.plot(x + 0.12 * (i - (len(runs) - 1) / 2), check.ratio,
                        marker=style["marker"], markersize=8, color=f"C{i}",
                        markerfacecolor=f"C{i}" if check.ok is False else "none",
                        linestyle="none", label=run.name if x == 0 else None)
        ax.set_xticks(xs, policies, rotation=30, fontsize=8)
        ax.set_ylabel(f"{metric.label}: simulated / live")
        ax.set_title(f"{metric.label} (shaded: within {metric.tolerance:.0%}; filled: out of"
                     " its tolerance)", fontsize=9)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=max(1, len(labels)),
               fontsize=8)
    fig.suptitle(title or "replay: simulated against live")
    return _save(fig, path)
