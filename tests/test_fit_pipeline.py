"""fit_artifact end to end on synthetic domain-structured signatures, plot_fit, and the
cross-fit's folds and cluster matching."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stages.errors import EldrError
from stages.fit.artifact import ArtifactStore
from stages.fit.cross_fit import fold_of, matched_ids
from stages.fit.fit_plot import plot_fit
from stages.fit.pipeline import FitConfig, distinct_experts_per_layer, fit_artifact
from stages.signature.dataset import ModelIdentity

IDENTITY = ModelIdentity(name="tiny-moe", num_layers=6, num_experts=16, top_k=2)


def domain_counts(seed: int, n: int = 320, domains: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Each domain prefers a few experts per layer, in prefill and decode alike."""
    rng = np.random.default_rng(seed)
    domain = rng.integers(0, domains, n)
    profiles = rng.dirichlet(np.full(16, 0.15), size=(domains, 6))
    prefill = rng.multinomial(rng.integers(10, 40, n)[:, None] * 2, profiles[domain])
    decode = rng.multinomial(np.full((n, 1), 16), profiles[domain])
    return prefill.astype(np.int32), decode.astype(np.int32)


def test_fit_artifact_end_to_end(tmp_path: Path) -> None:
    prefill, decode = domain_counts(seed=0)
    store = ArtifactStore(tmp_path / "artifacts")
    messages: list[str] = []
    config = FitConfig(k=4, seed=1, num_pairs=5000)
    artifact = fit_artifact(prefill, decode, IDENTITY, "d" * 64, config, store, messages.append)
    assert messages and store.load().version == artifact.version
    assert artifact.centroids.shape == (4, artifact.transform.dim)
    m = artifact.metrics
    sizes = m["cluster_sizes"]
    assert sum(sizes) == artifact.params["num_train"] == 256 and max(sizes) - min(sizes) <= 1
    assert 0 < m["mean_within_cluster_cosine"] <= 1
    assert len(m["rho_trace"]) == int(artifact.transform.layer_mask.sum()) == len(m["layers"])
    held = m["holdout"]
    assert held["num_requests"] == 64 and held["batch_size"] == 8
    # Routing same-domain requests together must shrink the experts a decode batch touches.
    assert (
        held["same_cluster_distinct_experts_per_layer"] < held["random_distinct_experts_per_layer"]
    )
    assert held["distinct_experts_reduction"] > 0.1
    # Per decode step too (16 tokens per request: a step sees far fewer experts than a whole
    # decode does).
    gain = m["expected_gain"]
    step = {r["batch_size"]: r for r in gain["batches"] if "change" in r}
    assert step[8]["change"] < -0.1 and gain["verdict"] == "gain"
    assert (
        step[8]["same_cluster_distinct_experts_per_layer"]
        < held["same_cluster_distinct_experts_per_layer"]
    )
    assert m["warnings"] == []  # 64 training signatures per cluster
    # Every request, labelled out of fold, in the artifact's cluster ids.
    assert gain["method"] == "cross-fit" and gain["folds"] == 5 and gain["num_holdout"] == 320
    assert gain["label_agreement"] > 0.95 and sum(gain["holdout_cluster_sizes"]) == 320
    assert artifact.params["folds"] == 5
    # Same data, same config: same content, same version.
    again = fit_artifact(prefill, decode, IDENTITY, "d" * 64, config, store)
    assert again.version == artifact.version

    png = plot_fit(artifact, tmp_path / "fit.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plain_kmeans_and_no_holdout(tmp_path: Path) -> None:
    """No held-out split: the whole-decode metric has nothing to measure, but the per-step
    gain is cross-fit on every request and needs none (it used to say "unknown" here)."""
    prefill, decode = domain_counts(seed=1, n=120)
    config = FitConfig(k=3, balanced=False, holdout_fraction=0.0, num_pairs=2000)
    artifact = fit_artifact(prefill, decode, IDENTITY, "e" * 64, config, ArtifactStore(tmp_path))
    assert artifact.params["balanced"] is False and artifact.params["num_holdout"] == 0
    assert "note" in artifact.metrics["holdout"]
    gain = artifact.metrics["expected_gain"]
    assert gain["num_holdout"] == 120 and gain["verdict"] == "gain"
    plot_fit(artifact, tmp_path / "plain.png")


def test_refuses_bad_input(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    prefill, decode = domain_counts(seed=2, n=20)
    with pytest.raises(EldrError, match="cannot make 20 clusters"):
        fit_artifact(prefill, decode, IDENTITY, "f", FitConfig(k=20), store)
    other = ModelIdentity(name="big", num_layers=48, num_experts=128, top_k=8)
    with pytest.raises(EldrError, match="expected"):
        fit_artifact(prefill, decode, other, "f", FitConfig(k=2), store)
    with pytest.raises(EldrError, match="decode profiles"):
        fit_artifact(prefill, np.zeros_like(decode), IDENTITY, "f", FitConfig(k=2), store)
    with pytest.raises(EldrError, match="holdout"):
        FitConfig(holdout_fraction=1.0)
    with pytest.raises(EldrError, match="at least 2 folds"):
        FitConfig(folds=1)
    # 25 requests, 20 clusters: the training split (20) makes them, a cross-fit part (20 of 25
    # in 5 folds) too, but not in 2 folds (12).
    prefill, decode = domain_counts(seed=2, n=25)
    with pytest.raises(EldrError, match=r"12 requests in a cross-fit training part \(2 folds\)"):
        fit_artifact(prefill, decode, IDENTITY, "f", FitConfig(k=20, folds=2), store)


def test_folds_are_seeded_and_even() -> None:
    fold = fold_of(23, 5, seed=3)
    assert np.array_equal(fold, fold_of(23, 5, seed=3))
    assert not np.array_equal(fold, fold_of(23, 5, seed=4))
    assert sorted(np.bincount(fold).tolist()) == [4, 4, 5, 5, 5]
    with pytest.raises(EldrError, match="between 2 and 3 folds"):
        fold_of(3, 4, seed=0)


def test_matching_renames_a_fold_s_clusters_to_the_reference_s() -> None:
    """A fold that found the reference's three clusters under other names, with a few rows
    misplaced: each name goes back to the reference cluster it stands for."""
    rng = np.random.default_rng(0)
    reference = np.eye(3)
    truth = np.repeat(np.arange(3), 20)
    x = reference[truth] + 0.2 * rng.random((60, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    names = np.array([2, 0, 1])  # reference cluster c is the fold's names[c]
    fold_labels = names[truth]
    fold_labels[[0, 21]] = fold_labels[[21, 0]]
    renamed = matched_ids(fold_labels, x, reference)
    assert np.array_equal(renamed[names], np.arange(3))
    # An empty fold cluster still gets the one name left.
    assert sorted(matched_ids(np.zeros(60, np.int64), x, reference).tolist()) == [0, 1, 2]


def test_distinct_experts_per_layer() -> None:
    active = np.zeros((2, 2, 4), bool)
    active[0, 0, [0, 1]] = True
    active[1, 0, [1, 2]] = True
    active[1, 1, 3] = True
    assert distinct_experts_per_layer(active) == pytest.approx((3 + 1) / 2)


def test_expected_step_experts_matches_sampling() -> None:
    """The closed form equals a Monte Carlo of requests drawing their top-k picks."""
    from stages.fit.batch_union import batch_union
    from stages.signature.inclusion import inclusion_log_complement

    rng = np.random.default_rng(3)
    decode = rng.multinomial(32, rng.dirichlet(np.full(16, 0.3), size=(4, 2)))  # [B=4, L=2, E]
    logc = np.stack([inclusion_log_complement(d, top_k=1) for d in decode])
    expected = batch_union(logc, (4,), num_layers=2)[4].mean  # the one batch of all four
    draws = []
    for _ in range(4000):
        active = np.zeros((2, 16), bool)
        for d in decode:
            for layer in range(2):
                active[layer, rng.choice(16, p=d[layer] / d[layer].sum())] = True
        draws.append(active.sum() / 2)
    assert abs(np.mean(draws) - expected) < 0.05
