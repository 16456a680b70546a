"""eldr-kv's decode decision against eldr-union's, in one process, per request.

What the proxy runs between a prefill's answer and the decode dispatch once the prompt's KV
matches are known: ``DecodeRouter.features`` (the signature's wire decode) and
``DecodeRouter.choose`` (the pick plus its dispatch bookkeeping). Tokenizing, hashing and
matching are left out (``examples/bench_routing.py`` times those): this isolates the objective.
Workers hold a steady number of requests in flight (each new one ends the oldest); each
request has a 2,000-token prompt of which every worker holds a 400-token system prompt and one
worker its history, and asks for 64-512 output tokens or sets none. Policies alternate in
rounds, so a busy host disturbs both alike.

    python -m examples.bench_kv_decision [--workers 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
from threadpoolctl import threadpool_limits

from examples.bench_routing import InFlight
from stages.bench.sim.synthetic import SyntheticSpec, synthetic_signatures
from stages.serve.proxy.router.decode_router import DecodeRouter, KVInputs
from stages.signature import wire


def kv_inputs(rng: np.random.Generator, workers: int, count: int) -> list[KVInputs]:
    """Per request: the prompt, what each worker holds of it, the output tokens asked."""
    inputs = []
    for _ in range(count):
        cached = np.full(workers, 400, dtype=np.int64)
        cached[rng.integers(workers)] = 1900
        inputs.append(KVInputs(2000, cached, int(rng.choice([0, 64, 256, 512]))))
    return inputs


def run(policy: str, packed: list[dict[str, object]], inputs: list[KVInputs],
        args: argparse.Namespace) -> np.ndarray:
    """features + choose + dispatch per request, in us."""
    router = DecodeRouter(args.workers, policy, None, seed=args.seed, model_top_k=args.top_k)
    loads = np.zeros(args.workers, np.int64)
    eligible = np.ones(args.workers, bool)
    in_flight = InFlight(loads, args.workers * args.in_flight)
    clock = time.perf_counter_ns
    warmup = 1000
    us = np.empty(args.requests)
    gc.collect()
    for i in range(warmup + args.requests):
        t0 = clock()
        features = router.features(packed[i % len(packed)])
        decision = router.choose(features, loads, eligible, inputs[i % len(inputs)])
        t1 = clock()
        in_flight.dispatch(decision)
        in_flight.retire()
        if i >= warmup:
            us[i - warmup] = (t1 - t0) / 1e3
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="eldr-union,eldr-kv")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=8, help="requests per worker")
    ap.add_argument("--requests", type=int, default=10000, help="timed, per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    threadpool_limits(1, user_api="blas")  # as run_proxy does
    spec = SyntheticSpec(num_requests=512, num_layers=args.layers, num_experts=args.experts,
                         top_k=args.top_k, num_domains=args.workers,
                         domain_experts=max(1, args.experts * 3 // 8), seed=args.seed)
    packed = [wire.encode(s) for s in synthetic_signatures(spec).prefill_counts]
    inputs = kv_inputs(np.random.default_rng(args.seed), args.workers, 512)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    print(f"decode decision (features + choose + dispatch), {args.workers} workers x"
          f" {args.in_flight} in flight, {args.layers}x{args.experts} top-{args.top_k}")
    for r in range(args.rounds):
        for policy in policies:
            us = run(policy, packed, inputs, args)
            p50, p99 = np.percentile(us, [50, 99])
            print(f"round {r + 1} {policy:11}: p50 {p50:6.1f} us  p99 {p99:6.1f} us"
                  f"  mean {us.mean():6.1f} us")


if __name__ == "__main__":
    main()
