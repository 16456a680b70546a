"""The replay's plot: simulated over live per policy, a panel per judged metric."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from stages.bench.metric_registry import REPLAYED
from stages.bench.plots import save_figure, series_style
from stages.bench.replay.validation import RunCheck


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
            style = series_style(i)
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
    return save_figure(fig, path)
