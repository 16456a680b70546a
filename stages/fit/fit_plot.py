"""`eldr fit`'s PNG: cluster sizes, the layer mask, and the per-step gain.

matplotlib's object API (Figure + Agg canvas): no pyplot global state, works without a display.
Every panel holds data: a layer search that stopped after one layer has no curve, so the mask
itself is drawn; a gain that could not be estimated shows the sizes of the clusters it was
estimated on against what the smallest batch needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from stages.fit.artifact import Artifact
from stages.fit.gain import MEMBERS_PER_SLOT


def plot_fit(artifact: Artifact, path: Path) -> Path:
    metrics = artifact.metrics
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_sizes, ax_mask, ax_gain = fig.subplots(1, 3)

    sizes = metrics.get("cluster_sizes", [])
    ax_sizes.bar(range(len(sizes)), sizes, color="tab:blue")
    _integer_axes(ax_sizes)
    ax_sizes.set(title=f"training cluster sizes\n{sum(sizes)} requests",
                 xlabel="cluster (decode worker)", ylabel="requests")

    _plot_mask(ax_mask, metrics.get("rho_trace", []), metrics.get("layers", []),
               artifact.identity.num_layers)
    gain = metrics.get("expected_gain", {})
    if any("change" in r for r in gain.get("batches", [])):
        _plot_gain(ax_gain, gain)
    else:
        _plot_holdout_sizes(ax_gain, gain)
    fig.suptitle(f"eldr fit, artifact {artifact.version}: {artifact.identity.describe()},"
                 f" k={artifact.num_clusters}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # No metadata: the bytes depend on the artifact alone (the same fit, the same file).
    fig.savefig(path, dpi=110, metadata={"Software": None})
    return path


def _integer_axes(ax: Axes) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _plot_mask(ax: Axes, trace: list[float], layers: list[int], num_layers: int) -> None:
    """Spearman rho along the greedy search when it took two steps or more, else the mask."""
    final = f"rho {trace[-1]:.3f}" if trace else "no rho"
    if len(trace) >= 2:
        steps = np.arange(1, len(trace) + 1)
        ax.plot(steps, trace, marker="o", color="tab:green")
        ax.set_xticks(steps if len(steps) <= 16 else steps[:: -(-len(steps) // 16)])
        ax.set_xlim(0.5, len(trace) + 0.5)
        ax.set(title=f"layer-mask search\n{len(layers)} of {num_layers} layers kept, {final}",
               xlabel="layers in mask (greedy order)",
               ylabel="Spearman rho (signature vs decode)")
        return
    kept = np.zeros(num_layers)
    kept[list(layers)] = 1.0
    ax.bar(range(num_layers), kept, color="tab:green")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yticks([0, 1], ["dropped", "kept"])
    ax.set_ylim(0, 1.15)
    ax.set(title=f"layer mask: {len(layers)} of {num_layers} layers kept, {final}"
           "\n(the search stopped after one layer)",
           xlabel="MoE layer", ylabel="in the signature")


def _plot_gain(ax: Axes, gain: dict[str, Any]) -> None:
    """Same-cluster vs random distinct experts per step at each estimated batch size, the
    change and its interval written above each pair."""
    rows = [r for r in gain["batches"] if "change" in r]
    where = np.arange(len(rows))
    same = [r["same_cluster_distinct_experts_per_layer"] for r in rows]
    rand = [r["random_distinct_experts_per_layer"] for r in rows]
    ax.bar(where - 0.2, same, 0.4, label="same cluster (ELDR)", color="tab:orange")
    ax.bar(where + 0.2, rand, 0.4, label="random (load balancer)", color="tab:gray")
    for x, r, top in zip(where, rows, np.maximum(same, rand), strict=True):
        lo, hi = r["change_ci"]
        ax.annotate(f"{r['change']:+.1%}\n[{lo:+.1%}, {hi:+.1%}]", (x, top), ha="center",
                    va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(where, [str(r["batch_size"]) for r in rows])
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylim(0, 1.3 * max(max(same), max(rand)))
    # Below the axes: above it would cover the annotations.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)
    level = round(100 * gain["confidence"])
    ax.set(
        title=f"expected per-step gain\n{_requests(gain)}, {level}% CI",
        xlabel="decode batch size",
        ylabel="expected distinct experts per layer",
    )


def _plot_holdout_sizes(ax: Axes, gain: dict[str, Any]) -> None:
    """Why there is no gain: requests per cluster against what a batch needs."""
    sizes = gain.get("holdout_cluster_sizes", [])
    batches = [int(r["batch_size"]) for r in gain.get("batches", [])]
    ax.bar(range(len(sizes)), sizes, color="tab:gray")
    if batches:
        need = MEMBERS_PER_SLOT * min(batches)
        ax.axhline(need, color="tab:red", linestyle="--",
                   label=f"needed for a batch of {min(batches)}: {need}")
        ax.set_ylim(0, 1.2 * max([need, *sizes]))
        ax.legend(fontsize=8)
    _integer_axes(ax)
    ax.set(title=f"per-step gain not estimated:\ntoo few of {_requests(gain)} per cluster",
           xlabel="cluster (decode worker)", ylabel="requests")


def _requests(gain: dict[str, Any]) -> str:
    """What the estimate ran on: every request out of fold, or (artifacts fit before the
    cross-fit) the held-out split."""
    n = gain.get("num_holdout", 0)
    if gain.get("method") == "cross-fit":
        return f"{n} requests ({gain['folds']}-fold cross-fit)"
    return f"{n} held-out requests"
