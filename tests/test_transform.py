"""Signature transform: IDF, unit rows, zero rows, and the greedy layer-mask search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from stages.signature.transform import (
    SignatureTransform,
    _centred_ranks,
    _cosine,
    _decode_similarity,
    _per_layer_terms,
    _spearman_columns,
    fit_idf,
    fit_transform,
    sample_pairs,
)

INFORMATIVE = (0, 2, 3)


def planted_counts(
    seed: int, n: int = 300, layers: int = 6, experts: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """Prefill counts follow the request's domain only in INFORMATIVE layers (elsewhere they
    are random); decode counts follow the domain in every layer."""
    rng = np.random.default_rng(seed)
    domain = rng.integers(0, 4, n)
    profiles = rng.dirichlet(np.full(experts, 0.3), size=(4, layers))
    noise = rng.dirichlet(np.full(experts, 0.3), size=(n, layers))
    prefill_p = profiles[domain].copy()
    for layer in range(layers):
        if layer not in INFORMATIVE:
            prefill_p[:, layer] = noise[:, layer]
    prefill = rng.multinomial(24, prefill_p).astype(np.int32)
    decode = rng.multinomial(24, profiles[domain]).astype(np.int32)
    return prefill, decode


def test_idf_formula() -> None:
    counts = np.zeros((4, 1, 3), np.int32)
    counts[:, 0, 0] = 1  # every prompt: df 4
    counts[0, 0, 1] = 5  # one prompt: df 1; expert 2 never used: df 0
    idf = fit_idf(counts)
    assert idf.dtype == np.float32
    expected = np.log(np.array([5 / 5, 5 / 2, 5 / 1]))
    assert np.allclose(idf[0], expected)


def test_apply_gives_unit_float32_rows_and_zero_for_zero() -> None:
    rng = np.random.default_rng(0)
    idf = rng.random((5, 8)).astype(np.float32) + 0.1
    mask = np.array([True, False, True, True, False])
    t = SignatureTransform(idf=idf, layer_mask=mask)
    assert t.dim == 3 * 8
    counts = rng.integers(0, 9, size=(10, 5, 8)).astype(np.int32)
    counts[3] = 0
    x = t.apply(counts)
    assert x.shape == (10, t.dim) and x.dtype == np.float32
    norms = np.linalg.norm(x, axis=1)
    assert np.allclose(np.delete(norms, 3), 1.0, atol=1e-6)
    assert not np.isnan(x).any() and np.all(x[3] == 0)
    # One signature at a time (the proxy's path) equals the batch path.
    assert np.allclose(t.apply(counts[5]), x[5], atol=1e-7)
    assert not np.isnan(t.apply(np.zeros((5, 8), np.int16))).any()
    # Counts x IDF of the kept layers, flattened.
    ref = (counts[5][mask] * idf[mask]).ravel()
    assert np.allclose(x[5], ref / np.linalg.norm(ref), atol=1e-6)
    with pytest.raises(ValueError, match="does not match"):
        t.apply(np.zeros((4, 8)))


def test_transform_is_immutable_and_validated() -> None:
    t = SignatureTransform(idf=np.ones((2, 3)), layer_mask=[True, False])
    assert t.idf.dtype == np.float32 and t.layer_mask.dtype == bool
    with pytest.raises(ValueError):
        t.idf[0, 0] = 5.0
    with pytest.raises(ValueError, match="no layer"):
        SignatureTransform(idf=np.ones((2, 3)), layer_mask=[False, False])
    with pytest.raises(ValueError, match="layer_mask"):
        SignatureTransform(idf=np.ones((2, 3)), layer_mask=[True])


def rho_for_mask(
    prefill_counts: np.ndarray,
    decode_counts: np.ndarray,
    idf: np.ndarray,
    mask: np.ndarray,
    seed: int,
    num_pairs: int = 30000,
) -> float:
    """Spearman rho for a given mask on the same pairs ``fit_transform`` samples: the peak its
    mask search must stop at."""
    prefill, decode = np.asarray(prefill_counts), np.asarray(decode_counts)
    left, right = sample_pairs(prefill.shape[0], num_pairs, np.random.default_rng(seed))
    target_rank = _centred_ranks(_decode_similarity(decode, left, right)[:, None])[:, 0]
    dots, sq_left, sq_right = _per_layer_terms(prefill, idf, left, right)
    layers = np.flatnonzero(mask)
    sim = _cosine(
        dots[:, layers].sum(axis=1), sq_left[:, layers].sum(axis=1), sq_right[:, layers].sum(axis=1)
    )
    return float(_spearman_columns(sim[:, None], target_rank)[0])


def test_mask_search_keeps_informative_layers_and_stops_at_the_peak() -> None:
    prefill, decode = planted_counts(seed=1)
    t, trace = fit_transform(prefill, decode, seed=0, num_pairs=20000)
    chosen = set(np.flatnonzero(t.layer_mask).tolist())
    assert chosen and chosen <= set(INFORMATIVE)
    assert len(trace) == len(chosen)
    assert all(b > a for a, b in itertools.pairwise(trace))  # rises to the peak
    # Stopped at the peak: adding any other layer would not raise rho.
    peak = rho_for_mask(prefill, decode, t.idf, t.layer_mask, seed=0, num_pairs=20000)
    assert peak == pytest.approx(trace[-1])
    for layer in sorted(set(range(prefill.shape[1])) - chosen):
        grown = t.layer_mask.copy()
        grown[layer] = True
        assert rho_for_mask(prefill, decode, t.idf, grown, seed=0, num_pairs=20000) <= peak


def test_fit_transform_is_deterministic_and_checks_input() -> None:
    prefill, decode = planted_counts(seed=2, n=120)
    a, trace_a = fit_transform(prefill, decode, seed=5)
    b, trace_b = fit_transform(prefill, decode, seed=5)
    assert np.array_equal(a.layer_mask, b.layer_mask) and trace_a == trace_b
    assert np.array_equal(a.idf, fit_idf(prefill))
    with pytest.raises(ValueError, match="both be"):
        fit_transform(prefill, decode[:, :2], seed=0)
    with pytest.raises(ValueError, match="equally similar"):
        fit_transform(prefill, np.zeros_like(decode), seed=0)
