"""Figures of traffic with history, beside ``summarize``'s: TTFT of first turns and of later
turns apart (a later turn's prompt holds its history, which a prefix cache may already hold),
and prefix-cache hit shares. Live runs and the simulator write the same keys
(``metric_registry.CONVERSATION_METRICS``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _ms(values_s: np.ndarray, q: float) -> float:
    return float(np.percentile(values_s, q) * 1000.0) if values_s.size else float("nan")


def ttft_by_turn(ttft_s: np.ndarray, turn: np.ndarray, success: np.ndarray) -> dict[str, float]:
    """p50/p99 TTFT (ms) of turn 1 and of turns >= 2, successful requests only."""
    ok = np.asarray(success, dtype=bool)
    ttft = np.asarray(ttft_s, dtype=np.float64)
    turn = np.asarray(turn)
    first, later = ttft[ok & (turn == 1)], ttft[ok & (turn >= 2)]
    return {
        "median_ttft_turn1_ms": _ms(first, 50), "p99_ttft_turn1_ms": _ms(first, 99),
        "median_ttft_later_ms": _ms(later, 50), "p99_ttft_later_ms": _ms(later, 99),
    }


def round_spread_ms(per_round_s: Sequence[np.ndarray]) -> float:
    """Max minus min over rounds of a latency's p50 (ms; e.g. the turns->=2 TTFT): the
    run-to-run noise a difference between routers must beat; NaN with fewer than two rounds."""
    medians = [_ms(np.asarray(v), 50) for v in per_round_s if len(v)]
    return max(medians) - min(medians) if len(medians) > 1 else float("nan")


def share(hits: float, queries: float) -> float:
    return hits / queries if queries > 0 else float("nan")
