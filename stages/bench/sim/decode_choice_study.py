"""Decode chosen at arrival against after prefill, and conditional disaggregation against
always-remote prefill, on the simulated conversation workload (``conversation_sim``).

Per seed, on the same conversations:
- eldr-kv with ``decode_choice`` ``after-prefill`` (the paper's rule) and ``arrival``, and the
  load balancers (rr, jsq, random, p2c): each one's distinct experts per decode step (summed
  over layers) averaged over the turns >= 2 (``ConversationOutcome.turn_distinct``); the
  expert gain of a choice is the best load balancer's figure minus its own, and ``kept`` is
  arrival's gain over after-prefill's.
- eldr-kv with ``local_prefill_below`` N against the same with 0, for either decode choice:
  TTFT p50 of the turns >= 2, TPOT p50 and p99 and the mean arrival-to-last-token time of
  every turn, and the share of turns >= 2 a decode worker prefilled itself; with always-remote
  prefill, the share of turns >= 2 whose history holder (the decode worker holding the most of
  the prompt) was idle at their arrival (a local prefill there would stall no one).
- with ``--holder-shared``, eldr-kv's ``local_prefill_rule`` ``holder`` (the history holder
  prefills when it runs at most ``--holder-running`` requests that will share at most the
  given share of the turn's decode steps) against always-remote in the same mode: TTFT p50 of
  the turns >= 2, TPOT p50 and p99 as ratios, and the shares of first and later turns local;
  a table per setting, seed by seed, closes the output.

``python -m stages.bench.sim.decode_choice_study --help`` runs it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from stages.bench.sim.conversation_sim import (
    ConversationOutcome,
    ConversationSimConfig,
    simulate_outcomes,
)
from stages.bench.sim.conversation_workload import SimConversationSpec, SimTurns
from stages.bench.sim.kv_objective_study import BALANCERS, POLICY, latency_cells
from stages.bench.sim.synthetic import SyntheticSpec, stand_in_artifact, synthetic_signatures
from stages.routing.cost_model import cost_model_for
from stages.routing.policy_config import PolicyConfig


def _later_distinct(outcome: ConversationOutcome, turns: SimTurns) -> float:
    return float(np.mean(outcome.turn_distinct[turns.turn >= 2]))


def _latency(outcome: ConversationOutcome, turns: SimTurns) -> dict[str, float]:
    cells = latency_cells(outcome, turns)
    return {"ttft_later_p50_ms": 1e3 * cells["ttft_later_p50"],
            "tpot_p50_ms": 1e3 * cells["tpot_p50"], "tpot_p99_ms": 1e3 * cells["tpot_p99"],
            # Arrival to last token, the mean over turns: the seconds a choice costs every
            # request it touches, summed (TTFT and TPOT x tokens in one currency).
            "latency_mean_ms": 1e3 * float(np.mean(outcome.done - outcome.arrival))}


@dataclass(frozen=True)
class HolderSweep:
    """Rule 'holder' settings to compare with always-remote prefill (``--holder-*``)."""

    shared: tuple[float, ...] = ()
    running: int = 1
    below: int = 1024
    only: bool = False  # skip the expert gain (the load balancers' runs)


def _ratio_key(choice: str, shared: float, cell: str) -> str:
    return f"{choice}_holder{shared:g}_{cell}"


def run_seed(base: ConversationSimConfig, arrays: object, top_k: int, artifact: object,
             local_below: Sequence[int], holder: HolderSweep = HolderSweep()
             ) -> dict[str, float]:
    """One seed's figures (see the module's docstring)."""
    def outcomes(policies: tuple[str, ...], **options: object
                 ) -> tuple[SimTurns, dict[str, ConversationOutcome]]:
        config = replace(base, policies=policies,
                         policy_config=PolicyConfig.from_mapping({POLICY: options}))
        turns, out, _ = simulate_outcomes(config, arrays, top_k, artifact)  # type: ignore[arg-type]
        return turns, out

    balancers = () if holder.only else BALANCERS
    turns, after = outcomes((POLICY, *balancers), decode_choice="after-prefill")
    _, arrival = outcomes((POLICY,), decode_choice="arrival")
    row = {}
    if balancers:
        balancer = min(_later_distinct(after[b], turns) for b in balancers)
        gain_after = balancer - _later_distinct(after[POLICY], turns)
        gain_arrival = balancer - _later_distinct(arrival[POLICY], turns)
        row = {"balancer_distinct": balancer, "gain_after_prefill": gain_after,
               "gain_arrival": gain_arrival, "kept": gain_arrival / gain_after}
    for choice, remote_run in (("arrival", arrival), ("after-prefill", after)):
        row |= {f"{choice}_remote_{k}": v for k, v in _latency(remote_run[POLICY], turns).items()}
        # A later turn whose history holder runs nothing could prefill there stalling no one.
        row[f"{choice}_remote_holder_idle_later"] = float(
            np.mean(remote_run[POLICY].holder_load[turns.turn >= 2] == 0))
        for n in local_below:
            _, local = outcomes((POLICY,), decode_choice=choice, local_prefill_below=n)
            row |= {f"{choice}_local{n}_{k}": v for k, v in _latency(local[POLICY], turns).items()}
            row[f"{choice}_local{n}_share_later"] = float(
                np.mean(local[POLICY].prefill_worker[turns.turn >= 2] < 0))
        remote = latency_cells(remote_run[POLICY], turns)
        for shared in holder.shared:
            _, local = outcomes((POLICY,), decode_choice=choice, local_prefill_rule="holder",
                                local_prefill_below=holder.below,
                                local_prefill_running=holder.running,
                                local_prefill_shared=shared)
            cells = latency_cells(local[POLICY], turns)
            went = local[POLICY].prefill_worker < 0
            row |= {_ratio_key(choice, shared, f"{c}_x"): cells[c] / remote[c]
                    for c in ("ttft_later_p50", "tpot_p50", "tpot_p99")}
            row[_ratio_key(choice, shared, "share_later")] = float(np.mean(went[turns.turn >= 2]))
            row[_ratio_key(choice, shared, "share_first")] = float(np.mean(went[turns.turn == 1]))
    return row


def print_holder_table(rows: Sequence[dict[str, float]], holder: HolderSweep) -> None:
    """Per setting and mode, seed by seed: TTFT p50 (t >= 2) and TPOT p99 against
    always-remote, and the share of later turns local; ``met`` when every seed's TTFT ratio
    is below 1 and its TPOT p99 ratio at most 1."""
    print(f"rule 'holder' (running <= {holder.running}, lacking < {holder.below}) against"
          " always-remote, per seed: TTFT p50 t>=2 x / TPOT p99 x / later turns local")
    for choice in ("after-prefill", "arrival"):
        for shared in holder.shared:
            key = partial(_ratio_key, choice, shared)
            cells = [(r[key("ttft_later_p50_x")], r[key("tpot_p99_x")], r[key("share_later")])
                     for r in rows]
            met = all(t < 1.0 and p <= 1.0 for t, p, _ in cells)
            print(f"{choice} shared <= {shared:g}: " + "; ".join(
                f"{t:.3f} / {p:.4f} / {100 * s:.1f}%" for t, p, s in cells)
                + (" -- met" if met else " -- not met"))


def _ci95(values: np.ndarray) -> str:
    """`` ± h``: the half-width of the seeds' mean's 95% interval (Student's t; seeds are
    independent runs), so a ratio's distance from 1 reads against its seed noise."""
    if values.size < 2:
        return ""
    from scipy.stats import t

    half = t.ppf(0.975, values.size - 1) * values.std(ddof=1) / np.sqrt(values.size)
    return f" ± {half:.2g}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--local-prefill-below", default="128",
                        help="thresholds to compare with always-remote prefill, comma separated")
    parser.add_argument("--conversations", type=int, default=600)
    parser.add_argument("--rate", type=float, default=4.0, help="conversations per second")
    parser.add_argument("--cost", default="gpu")
    parser.add_argument("--tail-quality", type=float, default=0.0,
                        help="share of the uncached tail's routing the token predictor gets"
                        " right (0: the mean token's routing only)")
    parser.add_argument("--holder-shared", default="",
                        help="rule 'holder' bounds on the share of a turn's decode steps its"
                        " holder's requests share, comma separated (empty: none compared)")
    parser.add_argument("--holder-running", type=int, default=1,
                        help="rule 'holder': the most requests the holder may run")
    parser.add_argument("--holder-below", type=int, default=1024,
                        help="rule 'holder': local only when the holder lacks fewer tokens")
    parser.add_argument("--holder-only", action="store_true",
                        help="skip the expert gain (the load balancers' runs): latency only")
    args = parser.parse_args(argv)
    holder = HolderSweep(tuple(float(x) for x in args.holder_shared.split(",") if x),
                         args.holder_running, args.holder_below, args.holder_only)
    spec = SyntheticSpec()
    cost = cost_model_for(args.cost, spec.num_layers, spec.num_experts)
    rows = []
    for seed in range(args.seeds):
        arrays = synthetic_signatures(replace(spec, seed=seed))
        artifact = stand_in_artifact(arrays, 16, seed=seed)
        workload = SimConversationSpec(conversations=args.conversations,
                                       conversation_rate=args.rate, seed=seed)
        base = ConversationSimConfig(cost=cost, workload=workload, seed=seed,
                                     arrival_tail_quality=args.tail_quality)
        below = [int(n) for n in args.local_prefill_below.split(",") if n]
        row = run_seed(base, arrays, spec.top_k, artifact, below, holder)
        rows.append(row)
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    for key in rows[0]:
        values = np.array([r[key] for r in rows])
        print(f"{key}: mean {values.mean():.4g}{_ci95(values)} (min {values.min():.4g},"
              f" max {values.max():.4g})")
    if holder.shared:
        print_holder_table(rows, holder)


if __name__ == "__main__":
    main()
