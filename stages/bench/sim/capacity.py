"""What request rate a simulated cluster sustains, from its cost model, so sweeps run below it.

Decode capacity: every decode worker runs a full batch of ``max_batch`` sequences, each step
producing one token per sequence, so it finishes ``max_batch / (tokens x step)`` requests a
second, ``tokens`` being the mean tokens a request decodes there and ``step`` the cost
model's step time at that batch and the distinct experts a full batch activates. That count is
a load balancer's (batches of requests drawn independently, without locality): for such a
batch the expected miss probability of expert (l, e) is exactly ``(1 - mean_r pi_r)^B``. Prefill
capacity: prefill workers back to back at the mean prompt length. The cluster's capacity is the
lower of the two; above it queues grow for as long as the run lasts and TPOT says more about
the run's length than about routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stages.bench.sim.sim_workload import output_lengths
from stages.errors import EldrError
from stages.routing.cost_model import CostModel
from stages.signature.dataset import SignatureArrays
from stages.signature.inclusion import decode_inclusion

# `--request-rate auto`: low, middle and high load, each below saturation.
AUTO_FRACTIONS = (0.5, 0.7, 0.85)


@dataclass(frozen=True)
class Capacity:
    decode_rps: float  # requests/s the decode workers finish with every batch slot full
    prefill_rps: float  # requests/s the prefill workers finish back to back
    num_decode: int
    batch: int  # slots per decode worker
    decode_tokens: float  # mean tokens a request decodes on its decode worker
    step_s: float  # step time of a full batch
    distinct_per_layer: float  # distinct experts per layer a full random batch activates

    @property
    def rps(self) -> float:
        return min(self.decode_rps, self.prefill_rps)

    def describe(self) -> str:
        bound = "decode" if self.decode_rps <= self.prefill_rps else "prefill"
        return (
            f"capacity {self.rps:.3g} req/s ({bound}-bound): decode {self.num_decode} workers"
            f" x {self.batch} slots / ({self.decode_tokens:.0f} tokens x"
            f" {1000 * self.step_s:.3g} ms per full-batch step at"
            f" {self.distinct_per_layer:.1f} distinct experts/layer) = {self.decode_rps:.3g}"
            f" req/s; prefill {self.prefill_rps:.3g} req/s"
        )


def cluster_capacity(
    cost: CostModel,
    arrays: SignatureArrays,
    top_k: int,
    *,
    num_prefill: int,
    num_decode: int,
    max_batch: int,
    output_tokens: int | None,
    max_output_tokens: int,
    first_token_from_prefill: bool = False,
) -> Capacity:
    """The capacity of the cluster ``SimConfig`` describes, on this dataset (the simulator
    draws its requests uniformly from the rows)."""
    if len(arrays) == 0:
        raise EldrError("the signature dataset is empty")
    rows = np.arange(len(arrays))
    lengths = output_lengths(arrays, rows, output_tokens, max_output_tokens)
    decode_tokens = float(lengths.mean()) - (1.0 if first_token_from_prefill else 0.0)
    pi = decode_inclusion(arrays.decode_counts, top_k, arrays.prefill_counts)
    miss = (1.0 - pi.mean(axis=0)) ** max_batch  # [L, E]
    distinct = float((1.0 - miss).sum(axis=1).mean())
    # A worker per core, as the simulator runs them unless told the cores they share.
    step = float(cost.on_own_core().step_time(max_batch, distinct))
    prompt = np.maximum(arrays.prompt_tokens.astype(np.float64), 1.0)
    prefill_s = float(np.mean(cost.prefill_time(prompt)))
    return Capacity(
        decode_rps=num_decode * max_batch / (decode_tokens * step),
        prefill_rps=num_prefill / prefill_s,
        num_decode=num_decode,
        batch=max_batch,
        decode_tokens=decode_tokens,
        step_s=step,
        distinct_per_layer=distinct,
    )


def rates_at(capacity: Capacity, fractions: Sequence[float]) -> list[float]:
    """Request rates at these fractions of the capacity, to three significant digits (a rate
    a user can type back)."""
    if any(not 0.0 < f for f in fractions):
        raise EldrError(f"capacity fractions must be > 0, got {list(fractions)}")
    return [float(f"{f * capacity.rps:.3g}") for f in fractions]


@dataclass(frozen=True)
class RateSpec:
    """One entry of ``--request-rate``: req/s, or a fraction of the capacity."""

    value: float
    of_capacity: bool = False


def parse_rates(text: str) -> list[RateSpec]:
    """Comma separated: numbers (req/s), ``inf`` (all at once), ``N%`` (of the capacity) or
    ``auto`` (``AUTO_FRACTIONS`` of it)."""
    specs: list[RateSpec] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            if part == "auto":
                specs += [RateSpec(f, of_capacity=True) for f in AUTO_FRACTIONS]
            elif part.endswith("%"):
                specs.append(RateSpec(float(part[:-1]) / 100.0, of_capacity=True))
            else:
                specs.append(RateSpec(float(part)))
        except ValueError as exc:
            raise EldrError(
                f"--request-rate takes req/s numbers, 'inf', 'N%' of capacity or 'auto',"
                f" comma separated: {text}"
            ) from exc
    if any(not s.value > 0 for s in specs):
        raise EldrError("--request-rate must be > 0")
    return specs


def resolve_rates(specs: list[RateSpec], capacity: Capacity | None) -> list[float]:
    relative = [s.value for s in specs if s.of_capacity]
    if relative and capacity is None:
        raise EldrError("rates relative to capacity ('auto', 'N%') need --simulate")
    fixed = iter(rates_at(capacity, relative) if capacity is not None else [])
    return [next(fixed) if s.of_capacity else s.value for s in specs]
