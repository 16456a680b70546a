"""A prompt's signature before its prefill runs: what each of its tokens is expected to route to.

A signature is a sum over the prompt's tokens of each token's top-k picks, so it is predicted
as a sum too: every token contributes the global mean routing of one token (``mean``, ``[L*E]``)
plus its own learned offset. The offsets of the tokens seen in the capture are stored as a
low-rank product, ``factors[row] @ basis`` (``[T, r] @ [r, L*E]``): exact when ``r`` reaches
``L*E`` (small models), a truncation of the fit for wide ones (48 x 128 experts), which keeps
the artifact and a prediction small: a 2,000-token prompt costs one gather of ``[2000, r]``
rows and one ``[r] @ [r, L*E]`` product. Tokens the capture never saw get the mean alone.

``stages.fit.token_fit`` fits it; the artifact stores it (``stages.fit.artifact``); the proxy
calls :meth:`TokenPredictor.predict_signature` at arrival, with the counts of the prompt's
cached prefix where the workers' expert events know them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ARRAY_NAMES = ("token_ids", "factors", "basis", "mean")


@dataclass(frozen=True, eq=False)
class TokenPredictor:
    token_ids: np.ndarray  # int32 [T], sorted, the tokens with a learned offset
    factors: np.ndarray  # float32 [T, r]
    basis: np.ndarray  # float32 [r, L*E]
    mean: np.ndarray  # float32 [L*E], one token's mean routing
    shape: tuple[int, int]  # (L, E)

    def __post_init__(self) -> None:
        num_layers, num_experts = self.shape
        width = num_layers * num_experts
        t, r = self.factors.shape if self.factors.ndim == 2 else (-1, -1)
        if self.token_ids.ndim != 1 or t != len(self.token_ids):
            raise ValueError(f"token_ids {self.token_ids.shape} and factors"
                             f" {self.factors.shape} disagree")
        if self.basis.shape != (r, width) or self.mean.shape != (width,):
            raise ValueError(f"basis {self.basis.shape} or mean {self.mean.shape} does not fit"
                             f" rank {r} and {num_layers} x {num_experts} experts")
        if len(self.token_ids) and (self.token_ids[0] < 0 or
                                    (np.diff(self.token_ids) <= 0).any()):
            raise ValueError("token_ids must be non-negative, sorted and distinct")
        # token id -> row of ``factors`` (-1: unseen), so a prediction is one gather; its last
        # entry (-1) stands for every id past the largest seen.
        size = int(self.token_ids[-1]) + 1 if len(self.token_ids) else 0
        row_of = np.full(size + 1, -1, np.int64)
        row_of[self.token_ids] = np.arange(len(self.token_ids))
        object.__setattr__(self, "_row_of", row_of)

    @property
    def rank(self) -> int:
        return int(self.basis.shape[0])

    def predict_counts(self, token_ids: np.ndarray) -> np.ndarray:
        """``[L, E]`` float64: the expected signature of these tokens (no cached part)."""
        ids = np.asarray(token_ids, dtype=np.int64).ravel()
        if len(ids) and ids.min() < 0:
            raise ValueError(f"token ids must be non-negative, got {ids.min()}")
        row_of: np.ndarray = self._row_of  # type: ignore[attr-defined]
        rows = row_of[np.minimum(ids, len(row_of) - 1)]
        rows = rows[rows >= 0]
        # float32 throughout (a float64 operand would copy ``basis`` to float64 every call,
        # 6x the time at 48 x 128 experts); float32 sums of a few thousand rows are exact
        # enough for a signature that is normalised before use.
        # The rows' sum as a BLAS product with ones: numpy's column sum is ~5x slower here.
        offset = (np.ones(len(rows), np.float32) @ self.factors.take(rows, axis=0)) @ self.basis
        counts = np.float32(len(ids)) * self.mean + offset
        # An offset is a least-squares estimate: a rare token may push an expert below zero.
        return np.maximum(counts, 0.0).astype(np.float64).reshape(self.shape)

    def predict_signature(
        self, token_ids: np.ndarray, cached_counts: np.ndarray | None, cached_tokens: int
    ) -> np.ndarray:
        """``[L, E]`` float64: the prompt's signature at arrival.

        ``cached_counts``: the exact counts of its first ``cached_tokens`` tokens (the cached
        prefix's blocks summed), or None when nothing is cached (``cached_tokens`` 0); the
        tokens after them are predicted.
        """
        ids = np.asarray(token_ids).ravel()
        if not 0 <= cached_tokens <= len(ids):
            raise ValueError(f"{cached_tokens} cached tokens of a {len(ids)}-token prompt")
        if cached_counts is None:
            if cached_tokens:
                raise ValueError(f"{cached_tokens} cached tokens but no cached counts")
            return self.predict_counts(ids)
        cached = np.asarray(cached_counts, dtype=np.float64)
        if cached.shape != self.shape:
            raise ValueError(f"cached counts {cached.shape}, the model's are {self.shape}")
        return cached + self.predict_counts(ids[cached_tokens:])

    def arrays(self) -> dict[str, np.ndarray]:
        """What the artifact stores, by ``ARRAY_NAMES``."""
        return {
            "token_ids": np.ascontiguousarray(self.token_ids, dtype=np.int32),
            "factors": np.ascontiguousarray(self.factors, dtype=np.float32),
            "basis": np.ascontiguousarray(self.basis, dtype=np.float32),
            "mean": np.ascontiguousarray(self.mean, dtype=np.float32),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], shape: tuple[int, int]) -> TokenPredictor:
        return cls(
            token_ids=np.asarray(arrays["token_ids"], dtype=np.int32),
            factors=np.asarray(arrays["factors"], dtype=np.float32),
            basis=np.asarray(arrays["basis"], dtype=np.float32),
            mean=np.asarray(arrays["mean"], dtype=np.float32),
            shape=(int(shape[0]), int(shape[1])),
        )
