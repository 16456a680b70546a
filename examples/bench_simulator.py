"""Simulate ELDR against the four load balancers on an 8P16D cluster, as `eldr bench --simulate`.

Without --data it makes synthetic clustered signatures (and a stand-in artifact) in two model
shapes, each with the cost model it fits:

- GPU-like: a Qwen3-30B-A3B-shaped model (48 MoE layers, 128 experts, top-8), 128-512 output
  tokens, the `gpu_like` cost preset;
- CPU-like: the bundled tiny model's shape (4 layers, 16 experts, top-2) with experts as large
  as vLLM's CPU MoE kernel was measured on, 32-64 output tokens, short prompts, `cpu_like`.
  A CPU cluster saturates well below 100 req/s; the tables show where.

With --data DATA.zarr (and --artifact ROOT, a fit artifact store) it uses captured signatures
and the GPU-like preset (or --cost FILE.json from `eldr bench --engine-cost`).

    .venv/bin/python examples/bench_simulator.py --rates 20,60,100 --duration 120
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from stages.bench.plots import write_plots
from stages.bench.report import format_comparison
from stages.bench.results import ComparisonResult
from stages.bench.sim.sim_workload import RoutingArtifact
from stages.bench.sim.simulator import SimConfig, simulate
from stages.bench.sim.synthetic import SyntheticSpec, stand_in_artifact, synthetic_signatures
from stages.errors import EldrError
from stages.routing.cost_model import CostModel, cpu_like, gpu_like
from stages.signature.dataset import SignatureArrays, SignatureDataset


@dataclass(frozen=True)
class Scenario:
    label: str
    arrays: SignatureArrays
    artifact: RoutingArtifact
    top_k: int
    cost: CostModel
    max_output_tokens: int


def synthetic_scenarios(num_decode: int, seed: int) -> list[Scenario]:
    out = []
    gpu = SyntheticSpec(seed=seed)
    cpu = SyntheticSpec(
        num_requests=2000,
        num_layers=4,
        num_experts=16,
        top_k=2,
        domain_experts=6,
        prompt_median=48,
        min_output=32,
        max_output=64,
        seed=seed,
    )
    for label, spec, cost in (
        ("GPU-like (synthetic 48L x 128E top-8)", gpu, gpu_like(gpu.num_layers, gpu.num_experts)),
        ("CPU-like (synthetic 4L x 16E top-2)", cpu, cpu_like(cpu.num_layers)),
    ):
        arrays = synthetic_signatures(spec)
        artifact = stand_in_artifact(arrays, num_decode, seed=seed)
        out.append(Scenario(label, arrays, artifact, spec.top_k, cost, spec.max_output))
    return out


def captured_scenario(args: argparse.Namespace) -> Scenario:
    dataset = SignatureDataset.open(args.data)
    arrays = dataset.read()
    ident = dataset.identity
    if args.artifact is None:
        artifact: RoutingArtifact = stand_in_artifact(arrays, args.decode, seed=args.seed)
    else:
        from stages.fit.artifact import ArtifactStore  # the fit stage is optional here

        artifact = ArtifactStore(args.artifact).load("latest")
    cost = CostModel.load(args.cost) if args.cost else gpu_like(ident.num_layers, ident.num_experts)
    return Scenario(ident.describe(), arrays, artifact, ident.top_k, cost, 512)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="signature dataset (zarr); synthetic if omitted")
    parser.add_argument("--artifact", type=Path, help="artifact store root (eldr fit)")
    parser.add_argument("--cost", type=Path, help="cost model JSON (eldr bench --engine-cost)")
    parser.add_argument("--rates", default="20,60,100", help="request rates, comma separated")
    parser.add_argument("--duration", type=float, default=120.0, help="simulated seconds")
    parser.add_argument("--prefill", type=int, default=8)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    args = parser.parse_args()
    try:
        rates = [float(r) for r in args.rates.split(",")]
        scenarios = (
            [captured_scenario(args)] if args.data else synthetic_scenarios(args.decode, args.seed)
        )
        for n, scenario in enumerate(scenarios):
            sweep = []
            for rate in rates:
                config = SimConfig(
                    cost=scenario.cost,
                    num_prefill=args.prefill,
                    num_decode=args.decode,
                    request_rate=rate,
                    duration_s=args.duration,
                    max_output_tokens=scenario.max_output_tokens,
                    seed=args.seed,
                )
                start = time.perf_counter()
                results = simulate(config, scenario.arrays, scenario.artifact, top_k=scenario.top_k)
                elapsed = time.perf_counter() - start
                comparison = ComparisonResult(rate, results)
                sweep.append(comparison)
                completed = next(iter(results.values())).metrics["completed"]
                title = (
                    f"{scenario.label}, {scenario.cost.name} cost, {args.prefill}P{args.decode}D,"
                    f" {rate:g} req/s, {args.duration:g} s, {completed} requests"
                    f" (simulated in {elapsed:.1f} s)"
                )
                print(format_comparison(comparison.metrics(), title), end="\n\n", flush=True)
            if args.plots:
                source = (f"simulated {args.prefill}P{args.decode}D, {scenario.label},"
                          f" {scenario.cost.name} cost")
                for path in write_plots(sweep, args.plots, source, prefix=f"scenario{n}-"):
                    print(f"wrote {path}")
    except EldrError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
