"""How many MoE layers eldr-union needs to keep: TPOT with 0 (all), 16, 8 and 4 sampled layers.

eldr-union scores each worker on the expert unions of an evenly spaced subset of the layers
(``sample_layers``), which bounds a routing decision's cost (``examples/bench_routing.py``).
This simulates a Qwen3-30B-A3B-shaped model (synthetic: 48 MoE layers x 128 experts, top-8,
``stages.bench.sim.synthetic``) on 8P16D with the GPU-like cost, at three localities: the synthetic
default (a request follows its domain with weight 0.7), weak (weight 0.15), and none (decode
profiles swapped between requests, ``locality_blend = 1``). Each cell is eldr-union's TPOT p50
/ p99 over jsq's on the same arrivals.

Synthetic layers share one domain structure; a model whose layers disagree more may need more
of them, which this cannot show.

    python examples/bench_sample_layers.py [--rates 60,100] [--duration 60]
"""

from __future__ import annotations

import argparse

from stages.bench.sim.simulator import SimConfig, simulate
from stages.bench.sim.synthetic import SyntheticSpec, stand_in_artifact, synthetic_signatures
from stages.routing.cost_model import gpu_like
from stages.routing.policy_config import PolicyConfig

LAYER_COUNTS = (0, 16, 8, 4)
LOCALITIES = (("domain 0.7", 0.7, 0.0), ("domain 0.15", 0.15, 0.0), ("none", 0.7, 1.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="60,100", help="request rates, comma separated")
    ap.add_argument("--duration", type=float, default=60.0, help="simulated seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    cost = gpu_like(48, 128)
    header = "  ".join(f"{'all' if n == 0 else n:>13}" for n in LAYER_COUNTS)
    print(f"eldr-union TPOT p50 / p99 over jsq, 8P16D gpu-like, {args.duration:g} s per cell")
    print(f"{'locality':<12} {'req/s':>6}  {header}")
    for label, weight, blend in LOCALITIES:
        arrays = synthetic_signatures(SyntheticSpec(seed=args.seed, domain_weight=weight))
        artifact = stand_in_artifact(arrays, 16, seed=args.seed)
        for rate in rates:
            cells = []
            for kept in LAYER_COUNTS:
                config = SimConfig(
                    cost=cost, request_rate=rate, duration_s=args.duration,
                    policies=("jsq", "eldr-union"), locality_blend=blend, seed=args.seed,
                    policy_config=PolicyConfig.from_mapping(
                        {"eldr-union": {"sample_layers": kept}}
                    ),
                )
                result = simulate(config, arrays, artifact, top_k=8)
                union, jsq = result["eldr-union"].metrics, result["jsq"].metrics
                cells.append(f"{union['p50_tpot_ms'] / jsq['p50_tpot_ms']:.3f} / "
                             f"{union['p99_tpot_ms'] / jsq['p99_tpot_ms']:.3f}")
            print(f"{label:<12} {rate:>6g}  " + "  ".join(f"{c:>13}" for c in cells))


if __name__ == "__main__":
    main()
