import numpy as np

from stages.routing.cost_model import CostModel
from stages.routing.scorers.load import added_step_s

COST = CostModel(num_layers=2, base_s=0.010, per_token_s=0.001, per_expert_s=0.0005)


def test_the_less_loaded_worker_costs_less_and_by_the_per_sequence_time() -> None:
    added = added_step_s(np.array([0, 3]), COST, distinct=4.0)
    # step(1) = 10 + 1 + 2 * 2 = 15 ms; step(4) + 3 * 1 = 10 + 4 + 4 + 3 = 21 ms
    np.testing.assert_allclose(added, [0.015, 0.021])
