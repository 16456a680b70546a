"""Fit the token-level signature predictor (``stages.signature.token_predictor``) on a capture.

A request's prefill signature is the sum of its tokens' routings, so the prefill counts are
regressed on the prompt's bag of token ids: ``counts_i ~ n_i * mean + sum_t x_it * offset_t``,
``mean`` the routing of the average token (total counts over total tokens), ``offset_t`` what
token ``t`` routes to beyond it. The offsets are a ridge fit, shrunk towards zero so a token
seen once or twice stays near the mean; it is solved in its dual (``[N, N]``, one
eigendecomposition of ``X X^T``), so its cost follows the number of requests, not the
vocabulary. The ridge strength is the one with the least exact leave-one-out error over a grid
(closed form from the same eigendecomposition). The offsets are stored truncated to
``max_rank`` (exact while ``L*E <= max_rank``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse

from stages.errors import EldrError
from stages.signature.token_predictor import TokenPredictor

MAX_RANK = 64
# Ridge strengths tried, as multiples of the mean eigenvalue of X X^T.
_RIDGE_GRID = np.logspace(-4, 1, 16)
# Offsets up to this many entries are factored exactly; larger ones by a randomized SVD with
# this oversampling and these power iterations (Halko, Martinsson, Tropp 2011).
_EXACT_SVD_ENTRIES = 4_000_000
_OVERSAMPLE = 10
_POWER_ITERATIONS = 2


@dataclass(frozen=True, eq=False)
class TokenFit:
    predictor: TokenPredictor
    ridge: float  # the chosen strength
    loo_r2: float  # leave-one-out R^2 of the offsets over the mean-only prediction


def bag_of_tokens(prompts: Sequence[np.ndarray]) -> tuple[sparse.csr_matrix, np.ndarray]:
    """``[N, T]`` token counts per prompt over the ``[T]`` sorted distinct tokens they hold."""
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    flat = (np.concatenate([np.asarray(p, np.int64) for p in prompts])
            if len(prompts) else np.zeros(0, np.int64))
    vocab, column = np.unique(flat, return_inverse=True)
    row = np.repeat(np.arange(len(prompts)), lengths)
    bag = sparse.csr_matrix(
        (np.ones(len(flat)), (row, column)), shape=(len(prompts), len(vocab))
    )
    bag.sum_duplicates()
    return bag, vocab


def fit_token_predictor(
    prompts: Sequence[np.ndarray], prefill_counts: np.ndarray, max_rank: int = MAX_RANK
) -> TokenFit:
    """The predictor of ``[N, L, E]`` prefill counts from the ``N`` prompts' token ids."""
    counts = np.asarray(prefill_counts, dtype=np.float64)
    if counts.ndim != 3 or len(counts) != len(prompts):
        raise EldrError(f"{len(prompts)} prompts but prefill counts of shape {counts.shape}")
    if len(prompts) < 2:
        raise EldrError("a token predictor needs at least 2 prompts")
    shape = (int(counts.shape[1]), int(counts.shape[2]))
    y = counts.reshape(len(counts), -1)
    bag, vocab = bag_of_tokens(prompts)
    lengths = np.asarray(bag.sum(axis=1)).ravel()
    if lengths.sum() == 0:
        raise EldrError("the prompts hold no tokens: nothing to fit a token predictor on")
    mean = y.sum(axis=0) / lengths.sum()
    residual = y - lengths[:, None] * mean
    gram = (bag @ bag.T).toarray()
    eigvals, eigvecs = np.linalg.eigh(gram)
    eigvals = np.maximum(eigvals, 0.0)
    projected = eigvecs.T @ residual
    if residual.shape[1] > residual.shape[0]:
        # Wide models (L*E above N): the leave-one-out error is a sum of squared row norms,
        # which an orthonormal change of columns keeps, so the residual's N-dim row space
        # carries it: the grid search then costs N^3 per strength, not N^2 L*E.
        _, triangle = np.linalg.qr(residual.T)
        ridge, loo_error = _loo_ridge(eigvals, eigvecs, eigvecs.T @ triangle.T, triangle.T)
    else:
        ridge, loo_error = _loo_ridge(eigvals, eigvecs, projected, residual)
    dual = eigvecs @ (projected / (eigvals + ridge)[:, None])
    factors, basis = _low_rank(bag, dual, max(1, min(max_rank, len(vocab), y.shape[1])))
    predictor = TokenPredictor(
        token_ids=vocab.astype(np.int32),
        factors=factors.astype(np.float32),
        basis=basis.astype(np.float32),
        mean=mean.astype(np.float32),
        shape=shape,
    )
    total = float((residual**2).sum())
    loo_r2 = 1.0 - loo_error / total if total > 0 else 0.0
    return TokenFit(predictor=predictor, ridge=ridge, loo_r2=loo_r2)


def _low_rank(bag: sparse.csr_matrix, dual: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``([T, rank], [rank, L*E])``: the top singular factors of the offsets ``bag.T @ dual``.

    Exact while the offsets are small; for a wide model's tens of thousands of tokens by
    thousands of experts (gigabytes dense) a seeded randomized SVD, which only multiplies by
    ``bag`` and ``dual`` and so never forms them.
    """
    tokens, width = bag.shape[1], dual.shape[1]
    if tokens * width <= _EXACT_SVD_ENTRIES:
        left, singular, right = np.linalg.svd(np.asarray(bag.T @ dual), full_matrices=False)
        return left[:, :rank] * singular[:rank], right[:rank]
    rng = np.random.default_rng(0)  # seeded: the same fit, the same artifact bytes
    sketch = np.asarray(bag.T @ (dual @ rng.standard_normal((width, rank + _OVERSAMPLE))))
    for _ in range(_POWER_ITERATIONS):
        sketch, _ = np.linalg.qr(sketch)
        sketch = np.asarray(bag.T @ (dual @ (dual.T @ np.asarray(bag @ sketch))))
    basis_left, _ = np.linalg.qr(sketch)
    small = np.asarray(bag @ basis_left).T @ dual  # [rank + oversample, L*E]
    left, singular, right = np.linalg.svd(small, full_matrices=False)
    return (basis_left @ left[:, :rank]) * singular[:rank], right[:rank]


def _loo_ridge(
    eigvals: np.ndarray, eigvecs: np.ndarray, projected: np.ndarray, residual: np.ndarray
) -> tuple[float, float]:
    """The grid's ridge strength with the least leave-one-out squared error, and that error.

    For a linear smoother ``H = K (K + lambda I)^-1`` a request's leave-one-out residual is its
    in-sample residual over ``1 - H_ii``: no refit per request.
    """
    scale = float(eigvals.mean()) or 1.0
    best = (float("inf"), float("inf"))
    squared = eigvecs**2
    for ridge in scale * _RIDGE_GRID:
        shrink = eigvals / (eigvals + ridge)
        fitted = eigvecs @ (shrink[:, None] * projected)
        leverage = np.minimum(squared @ shrink, 1.0 - 1e-9)
        error = float((((residual - fitted) / (1.0 - leverage)[:, None]) ** 2).sum())
        if error < best[1]:
            best = (float(ridge), error)
    return best
