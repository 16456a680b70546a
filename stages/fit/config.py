"""What one `eldr fit` is asked for: clusters, balance, seed, the held-out part and the gain's
cross-fit. Its own module so the fit's parts (the pipeline, the dial's input) share it without
importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from stages.errors import EldrError
from stages.fit.gain import GainConfig


@dataclass(frozen=True)
class FitConfig:
    k: int = 20
    balanced: bool = True
    seed: int = 0
    holdout_fraction: float = 0.2
    num_pairs: int = 30000
    max_iter: int = 50
    eval_batch_size: int = 8  # decode batch size for the held-out whole-decode metric
    gain: GainConfig = field(default_factory=GainConfig)  # cross-fit per-step gain estimate
    # Folds of the gain's cross-fit: each fit sees (folds - 1) / folds of the requests, as
    # many as the artifact's own fit at the default holdout fraction.
    folds: int = 5

    def __post_init__(self) -> None:
        if self.k < 1:
            raise EldrError(f"--k must be at least 1, got {self.k}")
        if self.folds < 2:
            raise EldrError(f"cross-fitting needs at least 2 folds, got {self.folds}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise EldrError(f"holdout fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.num_pairs < 1 or self.max_iter < 1 or self.eval_batch_size < 1:
            raise EldrError("num_pairs, max_iter and eval_batch_size must be positive")
