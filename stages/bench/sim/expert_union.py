"""Distinct experts a decode batch activates per step, from its requests' decode profiles.

A request's decode profile gives, per layer l and expert e, the fraction of its generated
tokens whose top-k picked e: ``pi[l, e] = decode_counts[l, e] / tokens`` (so ``sum_e pi = k``).
Treat each request's pick in a step as a draw with these inclusion probabilities,
independent across requests. Expert (l, e) is then active with probability
``h = 1 - prod_r (1 - pi_r[l, e])``, and the distinct experts summed over layers have

    mean = sum h,   variance ~= sum h (1 - h)   (Poisson-binomial).

Drawing k experts per request, layer and step instead costs batch x L x E work per step
(~2e10 operations for an 8P16D, 100 req/s, 120 s run); step time is linear in the distinct
count, so the exact mean gives the same mean step time and TPOT, and a Gaussian draw with the
variance above keeps the step-to-step spread. ``log(1 - pi)`` sums are kept per batch and
updated only when a request joins or leaves, so a step costs O(1) and a membership change
O(L x E).
"""

from __future__ import annotations

import numpy as np

from stages.signature.inclusion import PI_MAX, inclusion_log_complement


class DecodeProfiles:
    """``log(1 - pi)`` of dataset rows on demand, normalisation precomputed, results kept up
    to ``cache_bytes`` (every policy replays the same rows; the full table for a large dataset
    would not fit in memory, so rows past the budget are recomputed)."""

    def __init__(
        self,
        decode_counts: np.ndarray,
        prefill_counts: np.ndarray,
        top_k: int,
        cache_bytes: int = 256 << 20,
    ) -> None:
        self._cache: dict[int, np.ndarray] = {}
        self._cache_rows = cache_bytes // (decode_counts[0].size * 8) if len(decode_counts) else 0
        self._decode = decode_counts
        self._prefill = prefill_counts
        self._top_k = top_k
        # float64: exact for integer counts, and a locality blend's are fractional.
        per_layer = decode_counts.sum(axis=2, dtype=np.float64)  # [N, L]
        self._needs_fallback = (per_layer == 0).any(axis=1)
        self._scale = (top_k / np.maximum(per_layer, 1))[:, :, None]  # [N, L, 1]

    def log_complement(self, row: int) -> np.ndarray:
        """Read-only ``[L*E]`` float64 vector (shared between callers)."""
        hit = self._cache.get(row)
        if hit is not None:
            return hit
        value = self._compute(row)
        if len(self._cache) < self._cache_rows:
            value.flags.writeable = False
            self._cache[row] = value
        return value

    def _compute(self, row: int) -> np.ndarray:
        if self._needs_fallback[row]:
            return inclusion_log_complement(self._decode[row], self._top_k, self._prefill[row])
        pi = self._decode[row] * self._scale[row]
        np.minimum(pi, PI_MAX, out=pi)
        np.negative(pi, out=pi)
        np.log1p(pi, out=pi)
        return pi.ravel()


class ExpertUnion:
    """Running union statistics of the requests in one decode batch."""

    def __init__(self, size: int, min_active: float = 0.0) -> None:
        """``size`` = L*E; ``min_active`` = L*k, the fewest distinct experts a non-empty
        batch can activate (every token picks k per layer)."""
        self._log_miss = np.zeros(size, dtype=np.float64)
        self._min_active = float(min_active)
        self._members = 0
        self._stale = False
        self._mean = 0.0
        self._std = 0.0

    def add(self, log_complement: np.ndarray) -> None:
        self._log_miss += log_complement
        self._members += 1
        self._stale = True

    def remove(self, log_complement: np.ndarray) -> None:
        self._members -= 1
        if self._members == 0:
            # Start clean: no rounding residue carried from one busy period to the next.
            self._log_miss.fill(0.0)
        else:
            self._log_miss -= log_complement
        self._stale = True

    def _refresh(self) -> None:
        # q = P(expert missed by every member); mean = sum(1 - q), var = sum q (1 - q).
        q = np.exp(self._log_miss)
        sum_q = float(q.sum())
        self._mean = self._log_miss.size - sum_q
        self._std = float(np.sqrt(max(sum_q - float(q @ q), 0.0)))
        self._stale = False

    def mean(self) -> float:
        """Expected distinct experts (summed over layers) of a step of the current batch."""
        if self._stale:
            self._refresh()
        return self._mean

    def std(self) -> float:
        if self._stale:
            self._refresh()
        return self._std

    def draw(self, z: float) -> float:
        """A step's distinct count given a standard normal ``z``, kept within [L*k, L*E]."""
        if self._stale:
            self._refresh()
        return min(max(self._mean + self._std * z, self._min_active), float(self._log_miss.size))
