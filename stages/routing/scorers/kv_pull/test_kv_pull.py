import numpy as np

from stages.routing.scorers.kv_pull import kv_pull_s


def test_a_worker_pays_only_for_the_tokens_it_lacks() -> None:
    cost = kv_pull_s(100, np.array([0, 64, 100, 128]), 0.001)
    np.testing.assert_allclose(cost, [0.1, 0.036, 0.0, 0.0])


def test_an_unknown_prompt_costs_nothing_anywhere() -> None:
    assert kv_pull_s(100, None, 0.001) == 0.0
    assert kv_pull_s(0, np.array([0, 0]), 0.001) == 0.0
