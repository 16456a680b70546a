"""Signature transform: counts x IDF, keep the chosen layers, flatten, L2-normalise.

One implementation serves both the fit (calibration signatures) and the proxy (one request at a
time), so the vectors clustered offline and the vectors routed online cannot drift apart.

Fitting (ELDR section 1): IDF = log((N+1)/(df+1)) over the calibration prompts, where df counts
the prompts whose prefill picked expert e in layer l at least once. The layer mask is grown
greedily: each step adds the layer that most raises Spearman's rho between signature cosine
distance and decode-profile cosine distance over random request pairs, and the search stops
where rho peaks (no remaining layer raises it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Pair dot products are computed this many pairs at a time ([block, L, E] float32 temporaries).
_PAIR_BLOCK = 2048


@dataclass(frozen=True, eq=False)
class SignatureTransform:
    idf: np.ndarray  # float32 [L, E]
    layer_mask: np.ndarray  # bool [L]
    # Derived once so the per-request path is a gather, a multiply and a norm.
    _layers: np.ndarray = field(init=False, repr=False)
    _weights: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        idf = np.array(self.idf, dtype=np.float32)
        mask = np.array(self.layer_mask, dtype=bool)
        if idf.ndim != 2:
            raise ValueError(f"idf must be [L, E], got shape {idf.shape}")
        if mask.shape != (idf.shape[0],):
            raise ValueError(f"layer_mask must be [{idf.shape[0]}], got shape {mask.shape}")
        if not mask.any():
            raise ValueError("layer_mask selects no layer")
        if not np.isfinite(idf).all() or (idf < 0).any():
            raise ValueError("idf must be finite and non-negative")
        layers = np.flatnonzero(mask)
        weights = np.ascontiguousarray(idf[layers])
        for arr in (idf, mask, layers, weights):
            arr.setflags(write=False)
        object.__setattr__(self, "idf", idf)
        object.__setattr__(self, "layer_mask", mask)
        object.__setattr__(self, "_layers", layers)
        object.__setattr__(self, "_weights", weights)

    @property
    def num_layers(self) -> int:
        return int(self.idf.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.idf.shape[1])

    @property
    def dim(self) -> int:
        return int(self._weights.size)

    def apply(self, counts: np.ndarray) -> np.ndarray:
        """``[..., L, E]`` counts -> float32 ``[..., D]`` unit rows (zero rows stay zero)."""
        counts = np.asarray(counts)
        if counts.shape[-2:] != self.idf.shape:
            raise ValueError(
                f"signature shape {counts.shape[-2:]} does not match the transform's "
                f"{self.idf.shape}"
            )
        picked = counts[..., self._layers, :]
        x = np.multiply(picked, self._weights, dtype=np.float32)
        x = x.reshape(*counts.shape[:-2], self.dim)
        if x.ndim == 1:
            norm = np.float32(np.sqrt(np.dot(x, x)))
            if norm > 0:
                x /= norm
            return x
        norm = np.sqrt(np.einsum("...d,...d->...", x, x))[..., None]
        np.divide(x, norm, out=x, where=norm > 0)
        return x


def fit_idf(prefill_counts: np.ndarray) -> np.ndarray:
    """float32 ``[L, E]``: log((N+1)/(df+1)), df = prompts with count > 0 at (l, e)."""
    counts = np.asarray(prefill_counts)
    if counts.ndim != 3:
        raise ValueError(f"prefill_counts must be [N, L, E], got shape {counts.shape}")
    n = counts.shape[0]
    df = np.count_nonzero(counts > 0, axis=0)
    return np.log((n + 1) / (df + 1.0)).astype(np.float32)


def fit_transform(
    prefill_counts: np.ndarray,
    decode_counts: np.ndarray,
    seed: int,
    num_pairs: int = 30000,
) -> tuple[SignatureTransform, list[float]]:
    """Fit IDF and the layer mask on calibration requests.

    Returns the transform and the rho trace: ``trace[i]`` is Spearman's rho with the first
    ``i + 1`` layers the greedy search chose; it rises strictly and ends at the peak, so
    ``len(trace) == transform.layer_mask.sum()``.
    """
    prefill = np.asarray(prefill_counts)
    decode = np.asarray(decode_counts)
    if prefill.ndim != 3 or decode.shape != prefill.shape:
        raise ValueError(
            f"prefill and decode counts must both be [N, L, E], got {prefill.shape} and "
            f"{decode.shape}"
        )
    n = prefill.shape[0]
    if n < 3:
        raise ValueError(f"need at least 3 calibration requests to fit a transform, got {n}")
    idf = fit_idf(prefill)
    left, right = sample_pairs(n, num_pairs, np.random.default_rng(seed))
    target = _decode_similarity(decode, left, right)
    if np.ptp(target) == 0:
        raise ValueError("decode profiles are all equally similar; nothing to fit the mask to")
    mask, trace = greedy_layer_mask(prefill, idf, left, right, target)
    return SignatureTransform(idf=idf, layer_mask=mask), trace


def sample_pairs(n: int, num_pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Distinct-index request pairs: all of them when there are few, else a random sample."""
    total = n * (n - 1) // 2
    if total <= num_pairs:
        left, right = np.triu_indices(n, k=1)
        return left.astype(np.int64), right.astype(np.int64)
    left = rng.integers(0, n, size=num_pairs)
    right = (left + rng.integers(1, n, size=num_pairs)) % n  # never equal to left
    return left, right


def greedy_layer_mask(
    prefill: np.ndarray,
    idf: np.ndarray,
    left: np.ndarray,
    right: np.ndarray,
    target: np.ndarray,
) -> tuple[np.ndarray, list[float]]:
    """Greedy forward layer selection maximising Spearman rho against ``target`` similarity.

    Cosine over a layer subset M decomposes per layer: sum_{l in M} dot_l(i, j) divided by
    sqrt(sum_{l in M} |a_il|^2 * sum_{l in M} |a_jl|^2), so per-layer dots of every pair and
    per-layer squared norms of every request are computed once and each candidate mask costs
    O(pairs). Spearman on similarities equals Spearman on distances (1 - cos is monotone).
    """
    num_layers = prefill.shape[1]
    dots, sq_left, sq_right = _per_layer_terms(prefill, idf, left, right)
    target_rank = _centred_ranks(target[:, None])[:, 0]
    mask = np.zeros(num_layers, bool)
    cur_dot = np.zeros(len(left))
    cur_l = np.zeros(len(left))
    cur_r = np.zeros(len(left))
    trace: list[float] = []
    while not mask.all():
        cand = np.flatnonzero(~mask)
        sim = _cosine(
            cur_dot[:, None] + dots[:, cand],
            cur_l[:, None] + sq_left[:, cand],
            cur_r[:, None] + sq_right[:, cand],
        )
        rho = np.nan_to_num(_spearman_columns(sim, target_rank), nan=-np.inf)
        best = int(np.argmax(rho))
        if not np.isfinite(rho[best]) or (trace and rho[best] <= trace[-1]):
            break
        layer = int(cand[best])
        mask[layer] = True
        cur_dot += dots[:, layer]
        cur_l += sq_left[:, layer]
        cur_r += sq_right[:, layer]
        trace.append(float(rho[best]))
    if not mask.any():
        raise ValueError("no layer's signature correlates with the decode profiles")
    return mask, trace


def _per_layer_terms(
    prefill: np.ndarray, idf: np.ndarray, left: np.ndarray, right: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pair and layer: dot product and both squared norms of the IDF-weighted counts."""
    sq = np.empty(prefill.shape[:2])
    for a in range(0, len(prefill), _PAIR_BLOCK):
        x = np.multiply(prefill[a : a + _PAIR_BLOCK], idf, dtype=np.float32)
        sq[a : a + _PAIR_BLOCK] = np.einsum("nle,nle->nl", x, x)
    idf_sq = idf.astype(np.float32) ** 2
    dots = np.empty((len(left), prefill.shape[1]))
    for a in range(0, len(left), _PAIR_BLOCK):
        # (c_i * idf) . (c_j * idf) = (c_i * idf^2) . c_j: one multiply instead of two
        x = np.multiply(prefill[left[a : a + _PAIR_BLOCK]], idf_sq, dtype=np.float32)
        y = prefill[right[a : a + _PAIR_BLOCK]].astype(np.float32)
        dots[a : a + _PAIR_BLOCK] = np.einsum("ple,ple->pl", x, y)
    return dots, sq[left], sq[right]


def _decode_similarity(decode: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Cosine similarity of the pairs' decode profiles (raw counts over all layers).

    Raw counts, not IDF-weighted: the decode profile is the expert traffic a batch causes,
    which is what co-locating requests is meant to shrink.
    """
    flat = decode.reshape(decode.shape[0], -1)
    sq = np.empty(len(flat))
    for a in range(0, len(flat), _PAIR_BLOCK):
        x = flat[a : a + _PAIR_BLOCK].astype(np.float32)
        sq[a : a + _PAIR_BLOCK] = np.einsum("nd,nd->n", x, x)
    dots = np.empty(len(left))
    for a in range(0, len(left), _PAIR_BLOCK):
        x = flat[left[a : a + _PAIR_BLOCK]].astype(np.float32)
        y = flat[right[a : a + _PAIR_BLOCK]].astype(np.float32)
        dots[a : a + _PAIR_BLOCK] = np.einsum("pd,pd->p", x, y)
    return _cosine(dots, sq[left], sq[right])


def _cosine(dot: np.ndarray, sq_a: np.ndarray, sq_b: np.ndarray) -> np.ndarray:
    # A zero vector has cosine 0 with everything (distance 1), as apply() maps it to zero.
    denom = np.sqrt(sq_a * sq_b)
    return np.divide(dot, denom, out=np.zeros_like(dot, dtype=np.float64), where=denom > 0)


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks per column, ties sharing their average rank (as scipy's rankdata, but
    with an unstable quicksort, which is several times faster on 30,000 x 48 columns)."""
    n = values.shape[0]
    order = np.argsort(values, axis=0)
    ordered = np.take_along_axis(values, order, axis=0)
    differs = ordered[1:] != ordered[:-1]
    pos = np.arange(n)[:, None]
    starts_group = np.vstack([np.ones((1, values.shape[1]), bool), differs])
    ends_group = np.vstack([differs, np.ones((1, values.shape[1]), bool)])
    first = np.maximum.accumulate(np.where(starts_group, pos, 0), axis=0)
    last = np.minimum.accumulate(np.where(ends_group, pos, n - 1)[::-1], axis=0)[::-1]
    ranks = np.empty(values.shape)
    np.put_along_axis(ranks, order, (first + last) / 2 + 1, axis=0)
    return ranks


def _centred_ranks(values: np.ndarray) -> np.ndarray:
    """Average ranks per column, centred and scaled to unit norm."""
    ranks = _average_ranks(values)
    ranks -= ranks.mean(axis=0)
    norm = np.linalg.norm(ranks, axis=0)
    return np.divide(ranks, norm, out=np.zeros_like(ranks), where=norm > 0)


def _spearman_columns(values: np.ndarray, target_rank: np.ndarray) -> np.ndarray:
    """Spearman rho of each column of ``values`` with the target (NaN for a constant column)."""
    ranks = _centred_ranks(values)
    rho = target_rank @ ranks
    constant = np.ptp(values, axis=0) == 0
    rho[constant] = np.nan
    return rho
