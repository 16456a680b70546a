"""Several routing proxies on a delayed view: TPOT against one proxy, on a simulated cluster.

One proxy routes on the decode workers' exact in-flight counts. N proxies each route on their
own assignments at once and on the others' once the workers publish them, a publish delay
later (``SimConfig.proxies``, ``publish_delay_s``). This sweeps the delay at 4 proxies for
eldr-union and the best load balancer (join-shortest-queue), all on the same Poisson arrivals,
as `eldr bench --simulate --proxies 4 --publish-delay-ms D` runs one point:

    .venv/bin/python examples/sim_proxies.py            # 8P16D, gpu cost, 70% of capacity

Data: the signature dataset under $ELDR_HOME (``eldr capture``) if there is one, else synthetic
clustered signatures in Qwen3-30B-A3B's shape (48 layers, 128 experts, top-8; the simulator
examples' GPU-like scenario).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from stages import paths
from stages.bench.results import PolicyResult
from stages.bench.sim.capacity import cluster_capacity, rates_at
from stages.bench.sim.simulator import SimConfig, simulate
from stages.bench.sim.synthetic import SyntheticSpec, synthetic_signatures
from stages.errors import EldrError
from stages.routing.cost_model import cost_model_for
from stages.signature.dataset import SignatureArrays, SignatureDataset

POLICIES = ("eldr-union", "jsq")  # jsq: least in flight, the best load balancer here
DELAYS_MS = (0.0, 5.0, 20.0, 100.0)


@dataclass(frozen=True)
class Data:
    label: str
    arrays: SignatureArrays
    top_k: int
    num_layers: int
    num_experts: int


def load_data(path: Path, seed: int) -> Data:
    if path.exists():
        dataset = SignatureDataset.open(path)
        ident = dataset.identity
        return Data(f"{path} ({ident.describe()})", dataset.read(), ident.top_k,
                    ident.num_layers, ident.num_experts)
    spec = SyntheticSpec(seed=seed)
    return Data(f"synthetic {spec.num_layers}L x {spec.num_experts}E top-{spec.top_k} (no"
                f" dataset at {path})", synthetic_signatures(spec), spec.top_k,
                spec.num_layers, spec.num_experts)


def base_config(data: Data, args: argparse.Namespace) -> tuple[SimConfig, str]:
    """The cluster at ``args.load`` of its capacity, as `--request-rate N%` resolves it."""
    cost = cost_model_for(args.cost, data.num_layers, data.num_experts)
    config = SimConfig(cost=cost, num_prefill=args.prefill, num_decode=args.decode,
                       duration_s=args.duration, policies=POLICIES, seed=args.seed)
    capacity = cluster_capacity(cost, data.arrays, data.top_k, num_prefill=args.prefill,
                                num_decode=args.decode, max_batch=config.max_batch,
                                output_tokens=None, max_output_tokens=config.max_output_tokens)
    [rate] = rates_at(capacity, [args.load])
    return replace(config, request_rate=rate), capacity.describe()


def table_rows(points: list[tuple[int, float, dict[str, PolicyResult]]]) -> list[str]:
    """One line per point and policy; ratios are to the one-proxy point (the first)."""
    one = points[0][2]
    lines = [f"{'proxies':>7} {'delay ms':>8} {'policy':<11} {'TPOT p50':>9} {'p99':>8}"
             f" {'p50/1':>7} {'p99/1':>7} {'spread':>7}"]
    for proxies, delay_ms, results in points:
        for name, result in results.items():
            m, ref = result.metrics, one[name].metrics
            p50, p99 = m["median_tpot_ms"], m["p99_tpot_ms"]
            lines.append(f"{proxies:>7} {delay_ms:>8g} {name:<11} {p50:>9.2f} {p99:>8.2f}"
                         f" {p50 / ref['median_tpot_ms']:>7.3f}"
                         f" {p99 / ref['p99_tpot_ms']:>7.3f}"
                         f" {m['mean_decode_load_spread']:>7.2f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=paths.default_dataset(),
                        help="signature dataset (default: $ELDR_HOME's; synthetic if absent)")
    parser.add_argument("--cost", default="gpu", help="cost model: gpu, cpu or a JSON file")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of capacity")
    parser.add_argument("--proxies", type=int, default=4)
    parser.add_argument("--duration", type=float, default=120.0, help="simulated seconds")
    parser.add_argument("--prefill", type=int, default=8)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    try:
        data = load_data(args.data, args.seed)
        config, capacity = base_config(data, args)
        grid = [(1, 0.0)] + [(args.proxies, d) for d in DELAYS_MS]
        points = []
        for proxies, delay_ms in grid:
            run = replace(config, proxies=proxies, publish_delay_s=delay_ms / 1000.0)
            points.append((proxies, delay_ms, simulate(run, data.arrays, None,
                                                       top_k=data.top_k)))
    except EldrError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    completed = points[0][2][POLICIES[0]].metrics["completed"]
    print(f"data: {data.label}\n{capacity}")
    print(f"simulated {args.prefill}P{args.decode}D, {config.cost.name} cost,"
          f" {config.request_rate:g} req/s ({args.load:.0%} of capacity), {args.duration:g} s,"
          f" {completed} requests per point, seed {args.seed}")
    print("\n".join(table_rows(points)))
    print("spread: the mean, over dispatches, of the most minus the fewest requests in flight"
          " on a decode worker (true loads)")
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
