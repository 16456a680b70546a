"""The default local_prefill_below from the costs: where a local prefill stalls the batch beside
it as long as the remote path's fixed costs."""

import pytest

from stages.errors import EldrError
from stages.routing.cost_model import gpu_like
from stages.routing.local_prefill import default_local_prefill_below


def test_the_threshold_is_where_the_batchs_stall_meets_the_remote_paths_fixed_costs() -> None:
    cost = gpu_like(48, 128)  # prefill 10 ms + 80 us a token, hand-off 4 us a token
    # 8 x 80 us x n <= 10 ms + 2 ms + 4 us x n  <=>  n <= 18.9
    assert default_local_prefill_below(cost, 8) == 19
    n = default_local_prefill_below(cost, 8)
    assert n is not None
    lacking = n - 1  # a worker prefills what it lacks when that is below the threshold
    stall = 8 * cost.prefill_per_token_s * lacking
    assert stall <= cost.prefill_base_s + 0.002 + cost.kv_transfer_per_token_s * lacking
    assert (8 * cost.prefill_per_token_s * n
            > cost.prefill_base_s + 0.002 + cost.kv_transfer_per_token_s * n)


def test_a_larger_batch_lowers_the_threshold() -> None:
    cost = gpu_like(48, 128)
    thresholds = [default_local_prefill_below(cost, b) for b in (1, 4, 16, 64)]
    assert thresholds == sorted(thresholds, reverse=True)  # type: ignore[type-var]


def test_no_threshold_when_the_hand_off_costs_more_a_token_than_the_stall() -> None:
    cost = gpu_like(48, 128)
    from dataclasses import replace

    assert default_local_prefill_below(replace(cost, kv_transfer_per_token_s=1e-3), 4) is None
    with pytest.raises(EldrError, match="decode batch must be >= 1"):
        default_local_prefill_below(cost, 0)
