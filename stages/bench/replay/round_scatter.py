"""How far a replay's rounds scatter from their live rounds: the noise floor of its checks.

Each policy's live figure pools its rounds, and the replay replays each round alone, so the
two can be set side by side round by round: a round's simulated over live TPOT p50. Its mean
over a policy's rounds is where the replay puts that policy (the model's error, and the
engine's speed over the whole bench); its scatter about that mean is what the engine did in one
round that a replay of the round does not know (a VM's neighbours, the time-slicing of shared
cores), with whatever the model gets wrong round by round. A policy's figure over R rounds
carries that scatter over sqrt(R): a floor under any tolerance its check is held to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from stages.bench.metrics import RequestTable, request_tpot_s


@dataclass(frozen=True)
class RoundScatter:
    """Round-by-round log(simulated / live TPOT p50) about each policy's own mean."""

    sd: float  # pooled standard deviation (of the log ratio: relative, for small values)
    rounds: int  # rounds counted, all policies together
    policies: int
    rounds_per_policy: int

    @property
    def per_policy(self) -> float:
        """The scatter left in a policy's figure over its rounds (one SD)."""
        return self.sd / math.sqrt(self.rounds_per_policy)

    def describe(self) -> str:
        return (
            f"round by round, simulated over live TPOT p50 scatters {self.sd:.1%} (SD) about"
            f" each policy's own mean ({self.rounds} rounds of {self.policies} policies); over"
            f" a policy's {self.rounds_per_policy} rounds that leaves {self.per_policy:.1%} (SD)"
            " in its figure from the rounds alone: the engine's speed in each, and whatever the"
            " model misses round by round"
        )


def round_medians(tpot_s: Sequence[np.ndarray]) -> np.ndarray:
    """Each round's median TPOT (NaN where a round has none)."""
    out = np.full(len(tpot_s), np.nan)
    for i, values in enumerate(tpot_s):
        values = np.asarray(values, dtype=np.float64)
        values = values[np.isfinite(values)]
        if values.size:
            out[i] = float(np.median(values))
    return out


def simulated_round_tpot(table: RequestTable, sizes: Sequence[int]) -> list[np.ndarray]:
    """A simulated policy's TPOT per round (NaN where a request failed or had one token)."""
    tpot = request_tpot_s(table.success, table.output_tokens, table.ttft_s, table.latency_s)
    bounds = np.cumsum([0, *sizes])
    return [tpot[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]


def round_scatter(
    live: Mapping[str, Sequence[np.ndarray]], sim: Mapping[str, Sequence[np.ndarray]]
) -> RoundScatter | None:
    """Pooled over the policies both sides have, rounds aligned by position; None when no
    policy has two rounds with a TPOT on both sides."""
    deviations: list[np.ndarray] = []
    counts = []
    for name, live_rounds in live.items():
        if name not in sim or len(sim[name]) != len(live_rounds):
            continue
        ratio = np.log(round_medians(sim[name]) / round_medians(live_rounds))
        ratio = ratio[np.isfinite(ratio)]
        if ratio.size >= 2:
            deviations.append(ratio - ratio.mean())
            counts.append(ratio.size)
    if not deviations:
        return None
    pooled = np.concatenate(deviations)
    dof = pooled.size - len(deviations)
    return RoundScatter(
        sd=float(math.sqrt(float((pooled**2).sum()) / dof)),
        rounds=int(pooled.size),
        policies=len(deviations),
        rounds_per_policy=round(float(np.mean(counts))),
    )
