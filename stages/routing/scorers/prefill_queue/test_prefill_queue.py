import numpy as np

from stages.routing.cost_model import CostModel
from stages.routing.scorers.prefill_queue import prefill_ready_s

COST = CostModel(num_layers=1, base_s=0.0, per_token_s=0.0, per_expert_s=0.0,
                 prefill_base_s=0.01, prefill_per_token_s=0.001)


def test_a_cached_prefix_is_worth_its_tokens_and_a_queue_costs_its_own() -> None:
    ready = prefill_ready_s(
        1000, cached_tokens=np.array([0, 900, 900]), queued_tokens=np.array([0, 0, 2000]),
        queued_requests=np.array([0, 0, 1]), cost=COST)
    np.testing.assert_allclose(ready, [1.01, 0.11, 2.12])
    assert int(np.argmin(ready)) == 1


def test_a_long_enough_queue_outweighs_a_hit() -> None:
    ready = prefill_ready_s(1000, np.array([0, 1000]), np.array([0, 1500]), np.array([0, 2]),
                            COST)
    assert int(np.argmin(ready)) == 0
