"""The locality dial's plot: TPOT over the best load balancer against the blend strength, and
the agreement curve that places the user's data on the dial."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from stages.bench.metric_registry import OVER_BEST
from stages.bench.plots import save_figure, series_style
from stages.bench.sim.locality_sweep import LocalitySweep


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
            ax.plot(xs, ys, label=name, **series_style(i))
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
    return save_figure(fig, path)
