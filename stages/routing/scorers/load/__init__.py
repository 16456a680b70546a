"""Seconds per decode step a request adds to the cluster on each worker, blind to experts.

A request on a worker running ``n`` others takes its steps at that worker's step time and
makes each of theirs one sequence longer (``stages.routing.cost_model``): the change in the sum
of time per output token is ``step(n + 1) + n * per_token_s``. Experts are left out: this is the
term for a request whose signature is unknown.
"""

from __future__ import annotations

import numpy as np

from stages.routing.cost_model import CostModel


def added_step_s(loads: np.ndarray, cost: CostModel, distinct: float) -> np.ndarray:
    """[W] seconds per step; ``distinct``: experts per layer a step of any worker reads."""
    return cost.step_time(loads + 1, distinct) + loads * cost.per_token_s
