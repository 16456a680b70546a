"""What a policy is told about the deployment it routes for: facts, not user options.

The proxy fills it from its workers, artifact and served model, the simulator from its cluster
and dataset. Options a user tunes are the policy's own dataclass (``params``); a field belongs
here when no user would set it by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from stages.errors import EldrError

if TYPE_CHECKING:
    from stages.routing.cost_model import CostModel


@dataclass(frozen=True, eq=False)
class RoutingContext:
    num_workers: int  # decode workers
    seed: int = 0
    centroids: np.ndarray | None = None  # [K, D], K >= num_workers: the artifact's
    # Which worker serves each centroid; None spreads them (``cluster_map``).
    worker_of_centroid: np.ndarray | None = None
    worker_slots: int | None = None  # each worker's batch size (vLLM --max-num-seqs)
    top_k: int | None = None  # the model's experts per token; None: counts are unreadable
    cost: CostModel | None = None  # decode step-time model; None: a preset for the shape

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise EldrError(f"need at least one decode worker, got {self.num_workers}")
        if self.worker_slots is not None and self.worker_slots < 1:
            raise EldrError(f"worker slots must be >= 1, got {self.worker_slots}")
        if self.top_k is not None and self.top_k < 1:
            raise EldrError(f"top_k must be >= 1, got {self.top_k}")
