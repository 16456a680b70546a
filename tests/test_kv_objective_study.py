"""The issue-40 study: eldr-kv's latency cells over the best load balancer's and kv's."""

from __future__ import annotations

import numpy as np

from stages.bench.sim.conversation_sim import ConversationOutcome
from stages.bench.sim.conversation_workload import SimTurns
from stages.bench.sim.kv_objective_study import CELLS, latency_cells, ratios


def test_each_cell_is_over_the_best_balancer_and_over_kv() -> None:
    cells = {name: dict.fromkeys(CELLS, 1.0) for name in ("rr", "jsq", "random", "p2c")}
    cells["jsq"]["ttft_turn1_p50"] = 0.5  # the best balancer on this cell only
    cells["kv"] = dict.fromkeys(CELLS, 2.0)
    cells["eldr-kv"] = dict.fromkeys(CELLS, 1.0)
    r = ratios(cells)
    assert r["ttft_turn1_p50"] == (2.0, 0.5)
    assert r["tpot_p99"] == (1.0, 0.5)


def test_turn_one_and_later_turns_are_apart() -> None:
    turns = SimTurns(prompts=[np.zeros(4)] * 4, answers=[np.zeros(11)] * 4,
                     conversation=np.array([0, 0, 1, 1]), turn=np.array([1, 2, 1, 2]),
                     row=np.zeros(4, dtype=np.int64), start_s=np.zeros(2))
    arrival = np.zeros(4)
    first = np.array([0.01, 0.05, 0.01, 0.05])
    outcome = ConversationOutcome(arrival, first, first + 0.1, np.zeros(4), np.zeros(4),
                                  np.zeros(4), np.zeros(0), np.zeros(4), np.zeros(4),
                                  first / 2, first / 2)
    cells = latency_cells(outcome, turns)
    assert cells["ttft_turn1_p50"] == 0.01 and cells["ttft_later_p99"] == 0.05
    np.testing.assert_allclose(cells["tpot_p50"], 0.01)
