"""Balanced spherical k-means: balance, determinism, planted clusters, plain mode."""

from __future__ import annotations

import numpy as np
import pytest

from stages.fit.kmeans import balanced_spherical_kmeans


def planted(
    rng: np.random.Generator, sizes: list[int], dim: int, noise: float
) -> tuple[np.ndarray, np.ndarray]:
    centres = rng.standard_normal((len(sizes), dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    truth = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    x = centres[truth] + noise * rng.standard_normal((len(truth), dim)) / np.sqrt(dim)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), truth


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Labels equal up to renaming the clusters."""
    pairs = set(zip(a.tolist(), b.tolist(), strict=True))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def test_balanced_sizes_differ_by_at_most_one() -> None:
    rng = np.random.default_rng(0)
    # Very unequal natural clusters, and N not a multiple of k.
    x, _ = planted(rng, [700, 200, 60, 30, 13], dim=32, noise=0.8)
    res = balanced_spherical_kmeans(x, k=7, seed=3)
    sizes = np.bincount(res.labels, minlength=7)
    assert sizes.sum() == len(x)
    assert sizes.max() - sizes.min() <= 1
    assert res.assignment_gap <= 1e-6 * len(x)


def test_deterministic_for_a_seed() -> None:
    rng = np.random.default_rng(1)
    x, _ = planted(rng, [150] * 6, dim=24, noise=1.5)
    a = balanced_spherical_kmeans(x, k=6, seed=11)
    b = balanced_spherical_kmeans(x, k=6, seed=11)
    assert np.array_equal(a.labels, b.labels)
    assert np.array_equal(a.centroids, b.centroids)
    assert a.objective == b.objective and a.iterations == b.iterations


@pytest.mark.parametrize("balanced", [True, False])
def test_planted_clusters_are_recovered(balanced: bool) -> None:
    rng = np.random.default_rng(2)
    x, truth = planted(rng, [120] * 8, dim=64, noise=0.6)
    res = balanced_spherical_kmeans(x, k=8, seed=0, balanced=balanced)
    assert same_partition(res.labels, truth)
    norms = np.linalg.norm(res.centroids, axis=1)
    assert res.centroids.dtype == np.float32
    assert np.allclose(norms, 1.0, atol=1e-5)
    own = np.einsum("nd,nd->n", x, res.centroids[res.labels])
    assert res.objective == pytest.approx(float(own.sum()), rel=1e-5)


def test_plain_mode_keeps_unequal_clusters() -> None:
    rng = np.random.default_rng(3)
    x, truth = planted(rng, [400, 100, 40], dim=48, noise=0.5)
    plain = balanced_spherical_kmeans(x, k=3, seed=0, balanced=False)
    assert same_partition(plain.labels, truth)
    balanced = balanced_spherical_kmeans(x, k=3, seed=0, balanced=True)
    assert sorted(np.bincount(balanced.labels).tolist()) == [180, 180, 180]
    assert plain.objective > balanced.objective


def test_float16_input_matches_float32() -> None:
    rng = np.random.default_rng(4)
    x, truth = planted(rng, [100] * 5, dim=32, noise=0.5)
    res = balanced_spherical_kmeans(x.astype(np.float16), k=5, seed=0)
    assert same_partition(res.labels, truth)


def test_rejects_bad_k() -> None:
    x = np.eye(3, dtype=np.float32)
    with pytest.raises(ValueError, match="k must be"):
        balanced_spherical_kmeans(x, k=4, seed=0)


def test_incremental_sums_match_a_full_pass() -> None:
    from stages.fit.kmeans import _updated_sums, cluster_sums

    rng = np.random.default_rng(5)
    x = rng.standard_normal((500, 12)).astype(np.float32)
    old = rng.integers(0, 4, 500)
    new = old.copy()
    new[rng.choice(500, 40, replace=False)] = rng.integers(0, 4, 40)
    updated = _updated_sums(x, cluster_sums(x, old, 4), old, new, 4)
    assert np.allclose(updated, cluster_sums(x, new, 4), atol=1e-4)
