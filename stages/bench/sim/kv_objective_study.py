"""eldr-kv against the load balancers and the prefix-only rule (``kv``) on the simulated
conversation workload (``conversation_sim``): issue 40's latency cells.

Per seed, every policy on the same conversations (8 prefill + 16 decode workers by default):
TTFT p50 and p99 of turn 1 and of the turns >= 2, TPOT p50 and p99 of every turn. Each cell is
printed as eldr-kv's figure over the best (lowest) of the load balancers' (rr, jsq, random,
p2c) and over ``kv``'s; a cell at most 1.00 is met. eldr-kv's options come from
``--policy-config`` (the other policies run with their defaults).

``python -m stages.bench.sim.kv_objective_study --help`` runs it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from stages.bench.metrics import request_tpot_s
from stages.bench.sim.conversation_sim import (
    ConversationOutcome,
    ConversationSimConfig,
    simulate_outcomes,
)
from stages.bench.sim.conversation_workload import SimConversationSpec, SimTurns
from stages.bench.sim.synthetic import SyntheticSpec, synthetic_signatures
from stages.routing.cost_model import cost_model_for
from stages.routing.policy_config import PolicyConfig

BALANCERS = ("rr", "jsq", "random", "p2c")
PREFIX_ONLY = "kv"
POLICY = "eldr-kv"
CELLS = ("ttft_turn1_p50", "ttft_turn1_p99", "ttft_later_p50", "ttft_later_p99", "tpot_p50",
         "tpot_p99")


def latency_cells(outcome: ConversationOutcome, turns: SimTurns) -> dict[str, float]:
    """Seconds per cell of ``CELLS``."""
    ttft = outcome.first_token - outcome.arrival
    output = np.array([a.size for a in turns.answers])
    tpot = request_tpot_s(np.ones(len(turns), bool), output, ttft, outcome.done - outcome.arrival)
    first, later = ttft[turns.turn == 1], ttft[turns.turn >= 2]
    return {"ttft_turn1_p50": float(np.median(first)),
            "ttft_turn1_p99": float(np.percentile(first, 99)),
            "ttft_later_p50": float(np.median(later)),
            "ttft_later_p99": float(np.percentile(later, 99)),
            "tpot_p50": float(np.nanmedian(tpot)), "tpot_p99": float(np.nanpercentile(tpot, 99))}


def ratios(cells: dict[str, dict[str, float]]) -> dict[str, tuple[float, float]]:
    """Per cell: eldr-kv over the best balancer, and over ``kv``."""
    out = {}
    for cell in CELLS:
        best = min(cells[b][cell] for b in BALANCERS)
        out[cell] = (cells[POLICY][cell] / best, cells[POLICY][cell] / cells[PREFIX_ONLY][cell])
    return out


def run_seed(base: ConversationSimConfig, seed: int) -> dict[str, dict[str, float]]:
    """Every policy's cells on one seed's signatures and conversations."""
    spec = SyntheticSpec(seed=seed)
    arrays = synthetic_signatures(spec)
    config = replace(base, seed=seed, workload=replace(base.workload, seed=seed),
                     policies=(POLICY, PREFIX_ONLY, *BALANCERS))
    turns, outcomes, _ = simulate_outcomes(config, arrays, spec.top_k)
    return {name: latency_cells(o, turns) for name, o in outcomes.items()}


def _span(values: Sequence[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    parser.add_argument("--rate", type=float, default=4.0, help="conversations per second")
    parser.add_argument("--conversations", type=int, default=600)
    parser.add_argument("--cost", default="gpu")
    parser.add_argument("--policy-config", default="{}",
                        help="eldr-kv's options as JSON, e.g. '{\"eldr-kv\": {...}}'")
    args = parser.parse_args(argv)
    spec = SyntheticSpec()
    cost = cost_model_for(args.cost, spec.num_layers, spec.num_experts)
    workload = SimConversationSpec(conversations=args.conversations,
                                   conversation_rate=args.rate)
    base = ConversationSimConfig(cost=cost, workload=workload,
                                 policy_config=PolicyConfig.from_json(args.policy_config))
    per_seed = []
    for seed in range(args.seeds):
        cells = run_seed(base, seed)
        r = ratios(cells)
        per_seed.append(r)
        print(f"seed {seed}: " + ", ".join(
            f"{c} {1e3 * cells[POLICY][c]:.2f} ms ({r[c][0]:.3f} / {r[c][1]:.3f})"
            for c in CELLS), flush=True)
    print(f"rate {args.rate:g}, eldr-kv over the best balancer / over kv, lowest-highest over"
          f" {args.seeds} seeds:")
    for c in CELLS:
        print(f"  {c}: {_span([r[c][0] for r in per_seed])} /"
              f" {_span([r[c][1] for r in per_seed])}")


if __name__ == "__main__":
    main()
