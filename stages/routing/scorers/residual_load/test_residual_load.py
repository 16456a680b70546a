import numpy as np

from stages.routing.scorers.residual_load import shared_load


def test_a_worker_whose_requests_are_near_their_end_shares_fewer_steps() -> None:
    # Four in flight, 100 tokens each: each lasts four decisions. Worker 0's pair joined 3
    # decisions ago (one left), worker 1's just now (four left).
    shared = shared_load(np.array([0, 0, 1, 1]), np.array([3, 3, 0, 0]),
                         np.array([100, 100, 100, 100]), new_tokens=100, num_workers=3)
    np.testing.assert_allclose(shared, [0.5, 2.0, 0.0])


def test_a_short_new_request_shares_all_its_steps_with_a_long_one() -> None:
    # Two in flight: 300 and 100 tokens (mean 200): lives of 3 and 1 decisions.
    shared = shared_load(np.array([0, 1]), np.array([0, 0]), np.array([300, 100]),
                         new_tokens=100, num_workers=2)
    np.testing.assert_allclose(shared, [1.0, 1.0])
    shared = shared_load(np.array([0, 1]), np.array([0, 0]), np.array([300, 100]),
                         new_tokens=300, num_workers=2)
    np.testing.assert_allclose(shared, [1.0, 1.0 / 3.0])


def test_overdue_requests_count_for_nothing_and_an_idle_cluster_for_zero() -> None:
    shared = shared_load(np.array([0]), np.array([5]), np.array([10]), new_tokens=10,
                         num_workers=2)
    np.testing.assert_allclose(shared, [0.0, 0.0])
    np.testing.assert_allclose(shared_load(np.array([], dtype=np.int64), np.array([]),
                                           np.array([]), 10, 2), [0.0, 0.0])


def test_a_request_of_unknown_length_stays_throughout() -> None:
    # One known (100 tokens, two in flight: lasts two decisions, one left) and one unknown.
    shared = shared_load(np.array([0, 1]), np.array([1, 1]), np.array([100, 0]),
                         new_tokens=100, num_workers=2)
    np.testing.assert_allclose(shared, [0.5, 1.0])
    np.testing.assert_allclose(shared_load(np.array([0, 0]), np.array([9, 9]), np.array([0, 0]),
                                           100, 2), [2.0, 0.0])
