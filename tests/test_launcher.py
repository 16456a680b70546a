"""Core pinning and worker specs of the launcher (no processes started)."""

from __future__ import annotations

from stages.serve.launcher import core_plan


def test_two_cores_keep_prefill_and_decode_apart() -> None:
    assert core_plan(["prefill", "decode", "decode"], [0, 1]) == ["0", "1", "1"]


def test_enough_cores_give_disjoint_ranges() -> None:
    plan = core_plan(["prefill", "decode", "decode"], list(range(12)))
    assert plan == ["0-3", "4-7", "8-11"]


def test_one_core_is_shared() -> None:
    assert core_plan(["prefill", "decode"], [0]) == ["0", "0"]


def test_no_cores_known_lets_vllm_decide() -> None:
    assert core_plan(["prefill", "decode"], []) == [None, None]
