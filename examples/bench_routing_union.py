"""Routing decision time of the batch-aware policy (eldr-union), as the proxy runs it.

One decision = the proxy's calls for one request: ``DecodeRouter.features`` (wire decode of
the base64 int16 signature from ``kv_transfer_params``, the no-signature rule) and
``DecodeRouter.choose`` (the policy's choice over every worker and its dispatch bookkeeping).
Workers hold a steady number of in-flight requests (each new request ends the oldest), so
the per-worker expert unions are those of a busy cluster. Completion is timed apart: it runs
when a request ends, not while one waits for its worker. Synthetic Qwen3-30B-A3B-shaped
signatures (48 layers x 128 experts, top-8). Goal: p99 <= 50 us for a decision.

    python examples/bench_routing_union.py [--workers 16] [--in-flight 8] [--requests 20000]
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from stages.bench.synthetic import SyntheticSpec, synthetic_signatures
from stages.serve.decode_router import Decision, DecodeRouter
from stages.signature import wire
from stages.signature.dataset import ModelIdentity


@dataclass(frozen=True)
class IdentityOnly:
    """What the router reads of an artifact for eldr-union: the model's identity (top-k)."""

    version: str
    centroids: np.ndarray
    transform: object
    identity: ModelIdentity


def percentiles(us: np.ndarray) -> str:
    p50, p99, p999 = np.percentile(us, [50, 99, 99.9])
    return f"p50 {p50:6.1f} us  p99 {p99:6.1f} us  p99.9 {p999:6.1f} us  mean {us.mean():6.1f} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=8, help="requests per worker")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    threadpool_limits(1, user_api="blas")  # as run_proxy does
    distinct = 512  # signatures generated; requests cycle through them
    spec = SyntheticSpec(
        num_requests=distinct,
        num_layers=args.layers,
        num_experts=args.experts,
        top_k=args.top_k,
        num_domains=args.workers,
        domain_experts=max(1, args.experts * 3 // 8),
        seed=args.seed,
    )
    sigs = synthetic_signatures(spec).prefill_counts
    identity = ModelIdentity("synthetic", args.layers, args.experts, args.top_k)
    artifact = IdentityOnly("bench", np.eye(args.workers, dtype=np.float32), None, identity)
    router = DecodeRouter(args.workers, "eldr-union", artifact, seed=args.seed)
    packed = [wire.encode(s) for s in sigs]
    eligible = np.ones(args.workers, bool)
    loads = np.zeros(args.workers, np.int64)
    running: deque[Decision] = deque()

    def complete_oldest() -> None:
        done = running.popleft()
        done.on_complete(done.worker)
        loads[done.worker] -= 1

    capacity = args.workers * args.in_flight
    clock = time.perf_counter_ns
    warmup = 2000
    unpack = np.empty(args.requests)
    decide = np.empty(args.requests)
    finish = np.empty(args.requests)
    for i in range(warmup + args.requests):
        kv = packed[i % distinct]
        t0 = clock()
        features = router.features(kv)
        t1 = clock()
        decision = router.choose(features, loads, eligible)
        t2 = clock()
        loads[decision.worker] += 1
        running.append(decision)
        t3 = clock()
        if len(running) > capacity:
            complete_oldest()
        t4 = clock()
        if i >= warmup:
            j = i - warmup
            unpack[j], decide[j], finish[j] = (t1 - t0) / 1e3, (t2 - t1) / 1e3, (t4 - t3) / 1e3

    print(
        f"eldr-union routing, {args.workers} workers x {args.in_flight} in flight, signatures"
        f" {args.layers}x{args.experts} top-{args.top_k}, {args.requests} requests, 1 thread"
    )
    print(f"  signature decode : {percentiles(unpack)}")
    print(f"  choose + dispatch: {percentiles(decide)}")
    print(f"  decision (both)  : {percentiles(unpack + decide)}")
    print(f"  completion       : {percentiles(finish)}")
    verdict = "meets" if np.percentile(unpack + decide, 99) <= 50 else "MISSES"
    print(f"  goal p99 <= 50 us for a decision (signature decode included): {verdict}")


if __name__ == "__main__":
    main()
