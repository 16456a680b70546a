import numpy as np

from stages.routing.scorers.step_wait import step_wait_s


def test_a_busy_worker_costs_half_its_running_step_and_an_idle_one_nothing() -> None:
    wait = step_wait_s(np.array([0, 1, 3]), np.array([0.005, 0.008, 0.010]))
    np.testing.assert_allclose(wait, [0.0, 0.004, 0.005])


def test_one_step_time_for_every_worker() -> None:
    np.testing.assert_allclose(step_wait_s(np.array([2, 0]), 0.006), [0.003, 0.0])
