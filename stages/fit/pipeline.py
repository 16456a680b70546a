"""``eldr fit``: signatures in, one stored artifact out (transform, centroids, metrics).

Requests are split (seeded) into a training part, on which the transform and the centroids are
fit, and a held-out part, which measures what routing by centroid buys: the mean number of
distinct experts per layer that a decode batch of same-cluster requests activates, against
random batches of the same size (the quantity ELDR shrinks; fewer distinct experts means less
weight traffic per decode step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stages.errors import EldrError
from stages.fit.artifact import Artifact, ArtifactStore
from stages.fit.kmeans import balanced_spherical_kmeans
from stages.signature.dataset import ModelIdentity
from stages.signature.inclusion import inclusion_log_complement
from stages.signature.transform import fit_transform

# Random batches drawn for the baseline: enough for a stable mean even with few same-cluster
# batches.
_MIN_RANDOM_BATCHES = 256


@dataclass(frozen=True)
class FitConfig:
    k: int = 20
    balanced: bool = True
    seed: int = 0
    holdout_fraction: float = 0.2
    num_pairs: int = 30000
    max_iter: int = 50
    eval_batch_size: int = 8  # decode batch size for the held-out distinct-experts metric

    def __post_init__(self) -> None:
        if self.k < 1:
            raise EldrError(f"--k must be at least 1, got {self.k}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise EldrError(f"holdout fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.num_pairs < 1 or self.max_iter < 1 or self.eval_batch_size < 1:
            raise EldrError("num_pairs, max_iter and eval_batch_size must be positive")


def fit_artifact(
    prefill_counts: np.ndarray,
    decode_counts: np.ndarray,
    identity: ModelIdentity,
    dataset_hash: str,
    config: FitConfig,
    store: ArtifactStore,
    progress: Callable[[str], None] | None = None,
) -> Artifact:
    """Fit transform + (balanced) spherical k-means, save the artifact, return it as loaded."""
    say = progress or (lambda _msg: None)
    prefill, decode = _checked_counts(prefill_counts, decode_counts, identity)
    train, held = split_requests(len(prefill), config.holdout_fraction, config.seed)
    if len(train) < max(config.k, 3):
        raise EldrError(
            f"{len(train)} training requests cannot make {config.k} clusters; capture more "
            f"signatures or lower --k"
        )
    say(f"fitting the signature transform on {len(train)} requests ({len(held)} held out)")
    try:
        transform, rho_trace = fit_transform(
            prefill[train], decode[train], seed=config.seed, num_pairs=config.num_pairs
        )
    except ValueError as exc:
        raise EldrError(f"cannot fit the signature transform: {exc}") from exc
    layers = np.flatnonzero(transform.layer_mask)
    say(f"layer mask: {len(layers)} of {identity.num_layers} layers, rho {rho_trace[-1]:.4f}")
    x = transform.apply(prefill[train])
    kind = "balanced" if config.balanced else "plain"
    say(f"{kind} spherical k-means, k={config.k}, {len(train)} x {transform.dim}")
    km = balanced_spherical_kmeans(
        x, config.k, config.seed, config.balanced, config.max_iter, progress=say
    )
    metrics: dict[str, Any] = {
        "cluster_sizes": np.bincount(km.labels, minlength=config.k).tolist(),
        "mean_within_cluster_cosine": km.objective / len(train),
        "iterations": km.iterations,
        "assignment_gap_bound": km.assignment_gap,
        "rho_trace": rho_trace,
        "layers": layers.tolist(),
        "holdout": holdout_metrics(
            transform.apply(prefill[held]),
            decode[held],
            km.centroids,
            config.eval_batch_size,
            np.random.default_rng(config.seed + 1),
            step_profiles=np.stack([
                inclusion_log_complement(d, identity.top_k, fallback=p)
                for d, p in zip(decode[held], prefill[held], strict=True)
            ]) if len(held) else None,
        ),
    }
    params = {
        **asdict(config),
        "num_requests": len(prefill),
        "num_train": len(train),
        "num_holdout": len(held),
    }
    version = store.save(
        centroids=km.centroids,
        transform=transform,
        identity=identity,
        dataset_hash=dataset_hash,
        params=params,
        metrics=metrics,
    )
    say(f"saved artifact {version} in {store.root}")
    return store.load(version)


def split_requests(n: int, holdout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split into sorted (train, held-out) request indices."""
    order = np.random.default_rng(seed).permutation(n)
    n_held = round(n * holdout_fraction)
    return np.sort(order[n_held:]), np.sort(order[:n_held])


def distinct_experts_per_layer(active: np.ndarray) -> float:
    """Mean over layers of the experts that at least one request of the batch used.

    ``active``: bool ``[B, L, E]`` (decode count > 0).
    """
    return float(active.any(axis=0).sum(axis=1).mean())


def expected_step_experts_per_layer(log_complement: np.ndarray, num_layers: int) -> float:
    """Expected distinct experts per layer in one decode step of a batch.

    ``log_complement``: ``[B, L*E]`` per-request ``log(1 - pi)`` (see
    ``stages.bench.expert_union``): expert (l, e) is active in a step with probability
    ``1 - prod_r (1 - pi_r)``.
    """
    active = -np.expm1(log_complement.sum(axis=0))
    return float(active.sum() / num_layers)


def holdout_metrics(
    x: np.ndarray,
    decode: np.ndarray,
    centroids: np.ndarray,
    batch_size: int,
    rng: np.random.Generator,
    step_profiles: np.ndarray | None = None,
) -> dict[str, Any]:
    """Distinct experts per layer: batches of same-cluster held-out requests vs random ones.

    Held-out requests go to their nearest centroid (ELDR's tau = 0 rule, without load); each
    cluster's requests are shuffled and cut into full batches. Random batches of the same size
    are drawn from all held-out requests. Two measures: the experts a batch's requests used
    over their whole decode (saturates as answers grow), and, given ``step_profiles``
    (``[n, L*E]`` log-complements), the expected distinct experts of one decode step, the
    quantity a step's weight reads follow.
    """
    n = len(x)
    if n < batch_size:
        return {"num_requests": n, "batch_size": batch_size, "note": "too few held-out requests"}
    sims = x @ centroids.T
    labels = sims.argmax(axis=1)
    same_batches: list[np.ndarray] = []
    for j in range(len(centroids)):
        members = rng.permutation(np.flatnonzero(labels == j))
        for a in range(0, len(members) - batch_size + 1, batch_size):
            same_batches.append(members[a : a + batch_size])
    num_random = max(len(same_batches), _MIN_RANDOM_BATCHES)
    random_batches = [rng.choice(n, size=batch_size, replace=False) for _ in range(num_random)]
    active = decode > 0
    out: dict[str, Any] = {
        "num_requests": n,
        "batch_size": batch_size,
        "cluster_sizes": np.bincount(labels, minlength=len(centroids)).tolist(),
        "mean_cosine_to_nearest": float(sims.max(axis=1).mean()),
        "num_same_cluster_batches": len(same_batches),
        "num_random_batches": num_random,
    }
    measures = {"": lambda b: distinct_experts_per_layer(active[b])}
    if step_profiles is not None:
        num_layers = decode.shape[1]
        measures["step_"] = lambda b: expected_step_experts_per_layer(
            step_profiles[b], num_layers
        )
    for prefix, measure in measures.items():
        rand = float(np.mean([measure(b) for b in random_batches]))
        out[f"random_{prefix}distinct_experts_per_layer"] = rand
        if same_batches:
            same = float(np.mean([measure(b) for b in same_batches]))
            out[f"same_cluster_{prefix}distinct_experts_per_layer"] = same
            out[f"{prefix}distinct_experts_reduction"] = 1.0 - same / rand
    return out


def plot_fit(artifact: Artifact, path: Path) -> Path:
    """PNG: cluster sizes, rho along the layer-mask search, held-out distinct experts."""
    # Figure + Agg canvas directly: no pyplot global state, works without a display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    metrics = artifact.metrics
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_sizes, ax_rho, ax_experts = fig.subplots(1, 3)

    sizes = metrics.get("cluster_sizes", [])
    ax_sizes.bar(range(len(sizes)), sizes, color="tab:blue")
    ax_sizes.set(
        title="training cluster sizes", xlabel="cluster (decode worker)", ylabel="requests"
    )

    trace = metrics.get("rho_trace", [])
    ax_rho.plot(range(1, len(trace) + 1), trace, marker="o", color="tab:green")
    ax_rho.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_rho.set(
        title="layer-mask search (stops at the peak)",
        xlabel="layers in mask",
        ylabel="Spearman rho (signature vs decode)",
    )

    holdout = metrics.get("holdout", {})
    groups = [
        (label, holdout.get(f"same_cluster_{prefix}distinct_experts_per_layer"),
         holdout.get(f"random_{prefix}distinct_experts_per_layer"))
        for label, prefix in (("one decode step", "step_"), ("whole decode", ""))
    ]
    groups = [g for g in groups if g[1] is not None and g[2] is not None]
    if groups:
        where = np.arange(len(groups))
        ax_experts.bar(where - 0.2, [g[1] for g in groups], 0.4, label="same cluster",
                       color="tab:orange")
        ax_experts.bar(where + 0.2, [g[2] for g in groups], 0.4, label="random",
                       color="tab:gray")
        ax_experts.set_xticks(where, [g[0] for g in groups])
        ax_experts.legend()
        ax_experts.set(
            title=f"held-out decode batches of {holdout['batch_size']}",
            ylabel="distinct experts per layer",
        )
    else:
        ax_experts.set_axis_off()
        ax_experts.text(0.5, 0.5, "no held-out batches", ha="center", va="center")
    fig.suptitle(f"eldr artifact {artifact.version}: {artifact.identity.describe()}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _checked_counts(
    prefill_counts: np.ndarray, decode_counts: np.ndarray, identity: ModelIdentity
) -> tuple[np.ndarray, np.ndarray]:
    prefill, decode = np.asarray(prefill_counts), np.asarray(decode_counts)
    expected = (identity.num_layers, identity.num_experts)
    for name, arr in (("prefill", prefill), ("decode", decode)):
        if arr.ndim != 3 or arr.shape[1:] != expected:
            raise EldrError(
                f"{name} counts have shape {arr.shape}, expected [N, {expected[0]}, "
                f"{expected[1]}] for {identity.describe()}"
            )
    if len(prefill) != len(decode):
        raise EldrError(f"{len(prefill)} prefill but {len(decode)} decode signatures")
    if (prefill < 0).any() or (decode < 0).any():
        raise EldrError("signature counts must be non-negative")
    return prefill, decode
