"""``eldr fit``: signatures in, one stored artifact out (transform, centroids, metrics).

Requests are split (seeded) into a training part, on which the artifact's transform and
centroids are fit, and a held-out part, which the simulator and the whole-decode metric here
keep for requests the artifact never saw. What routing by centroid buys per decode step (the
distinct experts per layer that a decode batch of same-cluster requests activates, against
random batches of the same size: the quantity ELDR shrinks, fewer distinct experts meaning less
weight traffic per step), with an interval and the TPOT change it predicts, is estimated on
every request, each labelled by centroids fit without it (``stages.fit.cross_fit``,
``stages.fit.gain``): a held-out fifth is too few requests per cluster for the batch sizes
that matter.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import numpy as np

from stages.errors import EldrError
from stages.fit.arrival_gain import arrival_gain, arrival_queries
from stages.fit.artifact import Artifact, ArtifactStore
from stages.fit.config import FitConfig
from stages.fit.cross_fit import Clustering, CrossFit, Queries, cross_fit_labels
from stages.fit.dial import DialHook, DialInput
from stages.fit.gain import StepTimeModel, estimate_gain, gain_from_labels
from stages.fit.kmeans import balanced_spherical_kmeans
from stages.fit.prompt_tokens import PromptTokens
from stages.fit.token_fit import fit_token_predictor
from stages.provenance import command_line, provenance
from stages.signature.dataset import ModelIdentity
from stages.signature.inclusion import inclusion_log_complement
from stages.signature.transform import fit_transform

# Random batches drawn for the whole-decode baseline: enough for a stable mean even with few
# same-cluster batches.
_MIN_RANDOM_BATCHES = 256
# Fewer training signatures per cluster and a centroid fits a handful of requests: the
# within-cluster cosine looks perfect and says nothing about unseen traffic.
MIN_SIGNATURES_PER_CLUSTER = 20


def fit_artifact(
    prefill_counts: np.ndarray,
    decode_counts: np.ndarray,
    identity: ModelIdentity,
    dataset_hash: str,
    config: FitConfig,
    store: ArtifactStore,
    progress: Callable[[str], None] | None = None,
    cost: StepTimeModel | None = None,
    dial: DialHook | None = None,
    prompt_tokens: PromptTokens | None = None,
) -> Artifact:
    """Fit transform + (balanced) spherical k-means, save the artifact, return it as loaded.

    ``cost`` turns the per-step distinct-expert estimate into a TPOT change; without it only
    the expert counts are estimated. ``dial`` places the data on the locality dial; what it
    returns is stored as the metrics' ``dial``. ``prompt_tokens``, every request's prefilled
    token ids: a token predictor is fit and stored, and the share of the gain a signature made
    at arrival keeps is estimated (``stages.fit.arrival_gain``) into the gain's ``arrival``;
    without the ids (their ``missing`` says why) the gain's ``arrival`` says that.
    """
    say = progress or (lambda _msg: None)
    prefill, decode = _checked_counts(prefill_counts, decode_counts, identity)
    train, held = split_requests(len(prefill), config.holdout_fraction, config.seed)
    _check_enough(len(train), config.k, "training requests")
    # The smallest cross-fit training part leaves out the largest fold.
    _check_enough(len(prefill) - math.ceil(len(prefill) / config.folds), config.k,
                  f"requests in a cross-fit training part ({config.folds} folds)")
    say(f"fitting the signature transform on {len(train)} requests ({len(held)} held out)")
    fitted = fit_clustering(prefill[train], decode[train], config, say)
    transform, km = fitted.transform, fitted.kmeans
    x_held = transform.apply(prefill[held])
    profiles = step_profiles(prefill, decode, identity)  # every request's, held-out ones too
    say(f"per-step gain: {config.folds}-fold cross-fit over all {len(prefill)} requests,"
        f" batch sizes {list(config.gain.batch_sizes)}")
    tokens = None if prompt_tokens is None else prompt_tokens.tokens
    if tokens is not None and len(tokens) != len(prefill):
        raise ValueError(f"{len(tokens)} prompts' tokens for {len(prefill)} signatures")
    crossed = cross_fit(prefill, decode, fitted, config, say,
                        queries=None if tokens is None else arrival_queries(tokens, prefill))
    metrics: dict[str, Any] = {
        "cluster_sizes": np.bincount(km.labels, minlength=config.k).tolist(),
        "mean_within_cluster_cosine": km.objective / len(train),
        "iterations": km.iterations,
        "assignment_gap_bound": km.assignment_gap,
        "rho_trace": fitted.rho_trace,
        "layers": np.flatnonzero(transform.layer_mask).tolist(),
        "holdout": holdout_metrics(
            x_held, decode[held], km.centroids, config.eval_batch_size,
            np.random.default_rng(config.seed + 1),
        ),
        "expected_gain": cross_fit_gain(crossed, profiles, identity, config, cost),
        # The same estimate on the held-out requests only, with the artifact's own centroids:
        # the locality dial measures simulated datasets this way and places this value on it.
        "holdout_gain": estimate_gain(
            x_held, km.centroids, profiles[held], identity.num_layers, config.gain,
            np.random.default_rng(config.seed + 2), cost,
        ),
        "warnings": fit_warnings(
            len(train), config.k, km.objective / len(train), config.holdout_fraction
        ),
    }
    token_fit = None
    if tokens is not None:
        say(f"token predictor: fitting on all {len(tokens)} prompts' tokens")
        token_fit = fit_token_predictor(tokens, prefill)
        metrics["expected_gain"]["arrival"] = arrival_gain(
            crossed, profiles, identity.num_layers, config.k, config.gain, config.seed + 2,
            cost, token_fit,
        )
    elif prompt_tokens is not None:
        metrics["expected_gain"]["arrival"] = {"skipped": prompt_tokens.missing}
    if dial is not None:
        # Before the save: the metrics are part of the artifact's content hash.
        metrics["dial"] = dial(DialInput(
            identity, dataset_hash, config, crossed.labels, metrics["expected_gain"], cost
        ))
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
        provenance=fit_provenance(),  # what `eldr report` shows as the command and versions
        token_predictor=None if token_fit is None else token_fit.predictor,
    )
    say(f"saved artifact {version} in {store.root}")
    return store.load(version)


def fit_provenance() -> dict[str, str | None]:
    """This process's provenance, its command without ``--store``: where a fit is saved is
    not what it is, and the same fit saved in two stores is the same bytes."""
    kept: list[str] = []
    skip = False
    for arg in sys.argv:
        if skip:
            skip = False
        elif arg == "--store":
            skip = True
        elif not arg.startswith("--store="):
            kept.append(arg)
    return {**provenance(), "command": command_line(kept)}


def fit_clustering(
    prefill: np.ndarray,
    decode: np.ndarray,
    config: FitConfig,
    progress: Callable[[str], None] | None = None,
) -> Clustering:
    """The signature transform and (balanced) spherical k-means fit on these requests: the
    artifact's fit, and each cross-fit fold's."""
    say = progress or (lambda _msg: None)
    try:
        transform, rho_trace = fit_transform(
            prefill, decode, seed=config.seed, num_pairs=config.num_pairs
        )
    except ValueError as exc:
        raise EldrError(f"cannot fit the signature transform: {exc}") from exc
    layers = int(transform.layer_mask.sum())
    say(f"layer mask: {layers} of {transform.num_layers} layers, rho {rho_trace[-1]:.4f}")
    x = transform.apply(prefill)
    kind = "balanced" if config.balanced else "plain"
    say(f"{kind} spherical k-means, k={config.k}, {len(prefill)} x {transform.dim}")
    km = balanced_spherical_kmeans(
        x, config.k, config.seed, config.balanced, config.max_iter, progress=say
    )
    return Clustering(transform=transform, kmeans=km, rho_trace=rho_trace)


def cross_fit(
    prefill: np.ndarray,
    decode: np.ndarray,
    reference: Clustering,
    config: FitConfig,
    progress: Callable[[str], None] | None = None,
    queries: Queries | None = None,
) -> CrossFit:
    """Every request labelled by a clustering fit as ``fit_clustering`` fits the artifact, on
    the other folds, and named by ``reference``'s (the artifact's) clusters; ``queries``: see
    ``cross_fit_labels``."""
    return cross_fit_labels(
        prefill, reference, config.folds, config.seed,
        fit=lambda rows: fit_clustering(prefill[rows], decode[rows], config),
        progress=progress, queries=queries,
    )


def cross_fit_gain(
    crossed: CrossFit,
    profiles: np.ndarray,
    identity: ModelIdentity,
    config: FitConfig,
    cost: StepTimeModel | None,
) -> dict[str, Any]:
    """The per-step gain on every request, labelled by ``crossed``; ``profiles``: the
    requests' ``step_profiles``."""
    gain = gain_from_labels(
        crossed.labels, config.k, profiles, identity.num_layers, config.gain,
        np.random.default_rng(config.seed + 2), cost,
    )
    return {
        "method": "cross-fit",
        "folds": crossed.folds,
        "label_agreement": crossed.agreement,
        **gain,
    }


def step_profiles(
    prefill: np.ndarray, decode: np.ndarray, identity: ModelIdentity
) -> np.ndarray:
    """``[n, L*E]`` each request's per-step decode profile, ``log(1 - pi)``."""
    if not len(decode):
        return np.zeros((0, identity.num_layers * identity.num_experts))
    return np.stack([
        inclusion_log_complement(d, identity.top_k, fallback=p)
        for d, p in zip(decode, prefill, strict=True)
    ])


def _check_enough(rows: int, k: int, what: str) -> None:
    if rows < max(k, 3):
        raise EldrError(
            f"{rows} {what} cannot make {k} clusters; capture more signatures or lower --k"
        )


def split_requests(n: int, holdout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split into sorted (train, held-out) request indices."""
    order = np.random.default_rng(seed).permutation(n)
    n_held = round(n * holdout_fraction)
    return np.sort(order[n_held:]), np.sort(order[:n_held])


def held_out_rows(params: Mapping[str, Any], num_rows: int) -> np.ndarray | None:
    """The rows of a ``num_rows``-row dataset that a fit with ``params`` (an artifact's) held
    out, or None when the params do not describe a split of that many rows."""
    try:
        if int(params["num_requests"]) != num_rows:
            return None
        return split_requests(num_rows, float(params["holdout_fraction"]), int(params["seed"]))[1]
    except (KeyError, TypeError, ValueError):
        return None


def fit_warnings(
    num_train: int, k: int, mean_cosine: float, holdout_fraction: float
) -> list[str]:
    """What the user should know before trusting this fit."""
    per_cluster = num_train / k
    if per_cluster >= MIN_SIGNATURES_PER_CLUSTER:
        return []
    # Signatures to capture so the training split alone has enough per cluster.
    enough = math.ceil(MIN_SIGNATURES_PER_CLUSTER * k / (1.0 - holdout_fraction))
    fewer_k = max(1, num_train // MIN_SIGNATURES_PER_CLUSTER)
    return [
        f"k={k} is large for {num_train} training signatures: {per_cluster:.1f} per cluster"
        f" (fewer than {MIN_SIGNATURES_PER_CLUSTER}), so each centroid fits a few requests and"
        f" the mean within-cluster cosine ({mean_cosine:.3f}) says nothing about new traffic;"
        f" capture at least {enough} signatures for k={k}, or fit k<={fewer_k}"
    ]


def distinct_experts_per_layer(active: np.ndarray) -> float:
    """Mean over layers of the experts that at least one request of the batch used.

    ``active``: bool ``[B, L, E]`` (decode count > 0).
    """
    return float(active.any(axis=0).sum(axis=1).mean())


def holdout_metrics(
    x: np.ndarray,
    decode: np.ndarray,
    centroids: np.ndarray,
    batch_size: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Whole-decode distinct experts per layer: same-cluster held-out batches vs random ones.

    Held-out requests go to their nearest centroid (ELDR's tau = 0 rule, without load); each
    cluster's requests are shuffled and cut into full batches. Random batches of the same size
    are drawn from all held-out requests. The measure is the experts a batch's requests used
    over their whole decode; it saturates as answers grow, so the per-step estimate
    (``stages.fit.gain``) is the one that predicts step time.
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
    rand = float(np.mean([distinct_experts_per_layer(active[b]) for b in random_batches]))
    out["random_distinct_experts_per_layer"] = rand
    if same_batches:
        same = float(np.mean([distinct_experts_per_layer(active[b]) for b in same_batches]))
        out["same_cluster_distinct_experts_per_layer"] = same
        out["distinct_experts_reduction"] = 1.0 - same / rand
    return out


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
