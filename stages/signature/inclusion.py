"""A request's per-step expert inclusion probabilities, from its decode counts.

A request's decode profile gives, per layer l and expert e, the fraction of its generated
tokens whose top-k picked e: ``pi[l, e] = decode_counts[l, e] / tokens`` (so
``sum_e pi = k``). One decode step of a batch activates expert (l, e) with probability
``1 - prod_r (1 - pi_r[l, e])``, requests drawn independently. Kept as ``log(1 - pi)`` so a
batch's miss probability is a sum. Shared by the fit (held-out gain estimate) and the
simulator (step times), so both read a decode profile the same way.
"""

from __future__ import annotations

import numpy as np

# pi = 1 would make log(1 - pi) = -inf and poison a running sum on removal.
PI_MAX = 1.0 - 1e-9


def inclusion_probabilities(counts: np.ndarray, top_k: int) -> np.ndarray:
    """``pi`` as float64 ``[..., L, E]`` for ``[..., L, E]`` counts (one request or many), at
    most ``PI_MAX``; a layer without counts gets a uniform ``k/E``. The proxy's batch-aware
    policy reads a prefill signature this way, as a prediction of the decode profile."""
    per_layer = counts.sum(axis=-1, dtype=np.float64)
    num_experts = counts.shape[-1]
    scale = top_k / np.where(per_layer > 0, per_layer, 1.0)
    pi = counts * scale[..., None]
    if not per_layer.all():
        pi[per_layer == 0] = top_k / num_experts
    return np.minimum(pi, PI_MAX, out=pi)


def decode_inclusion(
    decode_counts: np.ndarray, top_k: int, fallback: np.ndarray | None = None
) -> np.ndarray:
    """``pi`` of ``[..., L, E]`` decode counts; a layer without decode counts (a one-token
    answer) uses ``fallback`` (its prefill counts), else a uniform ``k/E``."""
    counts = decode_counts
    if fallback is not None:
        empty = decode_counts.sum(axis=-1) == 0
        if empty.any():
            counts = np.where(empty[..., None], fallback, decode_counts)
    return inclusion_probabilities(counts, top_k)


def inclusion_log_complement(
    decode_counts: np.ndarray, top_k: int, fallback: np.ndarray | None = None
) -> np.ndarray:
    """``log(1 - pi)`` flattened to ``[L*E]`` for one request's ``[L, E]`` decode counts
    (``decode_inclusion``'s fallback for empty layers)."""
    return np.log1p(-decode_inclusion(decode_counts, top_k, fallback)).ravel()
