"""The signature at arrival: the cached prefix's exact counts plus the predictor's tail."""

import numpy as np
import pytest

from stages.routing.arrival_signature import arrival_signature
from stages.routing.kv.block_experts import BlockExperts
from stages.signature.token_predictor import TokenPredictor

SHAPE = (2, 4)
BLOCK = 4


def _predictor() -> TokenPredictor:
    # Token 7 routes to expert 3 beyond the mean; every token's mean routing is expert 0.
    mean = np.zeros(8, np.float32)
    mean[[0, 4]] = 1.0
    basis = np.zeros((1, 8), np.float32)
    basis[0, [3, 7]] = 2.0
    return TokenPredictor(np.array([7], np.int32), np.ones((1, 1), np.float32), basis, mean,
                          SHAPE)


def _index(blocks: dict[int, np.ndarray]) -> BlockExperts:
    index = BlockExperts()
    for h, counts in blocks.items():
        index.stored(h, counts.astype(np.uint8))
    return index


def test_nothing_cached_is_the_prediction_of_the_whole_prompt() -> None:
    ids = [1, 7, 2, 3, 5, 6]
    got = arrival_signature(ids, [10], BLOCK, _index({}), _predictor())
    assert got.cached_tokens == 0
    np.testing.assert_array_equal(got.counts, np.rint(_predictor().predict_counts(ids)))
    assert got.counts.dtype == np.int32 and got.counts.shape == SHAPE


def test_cached_blocks_are_exact_and_only_the_tail_is_predicted() -> None:
    first = np.full(SHAPE, 3)
    second = np.full(SHAPE, 5)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 7, 9]
    # Blocks 10 and 11 known; 12 is not: only the tokens after the second block are predicted.
    got = arrival_signature(ids, [10, 11], BLOCK, _index({10: first, 11: second}), _predictor())
    assert got.cached_tokens == 8
    want = first + second + _predictor().predict_counts(np.array([7, 9]))
    np.testing.assert_array_equal(got.counts, np.rint(want))


def test_a_known_block_after_an_unknown_one_is_not_a_cached_prefix() -> None:
    ids = list(range(8))
    got = arrival_signature(ids, [10, 11], BLOCK, _index({11: np.full(SHAPE, 9)}), _predictor())
    assert got.cached_tokens == 0
    np.testing.assert_array_equal(got.counts, np.rint(_predictor().predict_counts(ids)))


def test_without_a_predictor_the_prefix_routing_is_carried_over_the_tail() -> None:
    ids = list(range(12))  # one cached block of 4: the whole prompt is 3x its counts
    got = arrival_signature(ids, [10, 11, 12], BLOCK, _index({10: np.full(SHAPE, 2)}), None)
    assert got.cached_tokens == 4
    np.testing.assert_array_equal(got.counts, np.full(SHAPE, 6))


def test_without_a_predictor_or_a_cached_block_nothing_is_known() -> None:
    got = arrival_signature(list(range(8)), [10, 11], BLOCK, _index({}), None)
    assert got.counts is None and got.cached_tokens == 0


def test_expert_events_of_another_shape_are_ignored() -> None:
    index = _index({10: np.full((3, 4), 2)})
    ids = list(range(6))
    got = arrival_signature(ids, [10], BLOCK, index, _predictor())
    assert got.cached_tokens == 0
    np.testing.assert_array_equal(got.counts, np.rint(_predictor().predict_counts(ids)))


def test_more_blocks_than_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="3 blocks"):
        arrival_signature(list(range(8)), [1, 2, 3], BLOCK, _index({}), _predictor())
