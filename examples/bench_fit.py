"""Fit-time benchmark: balanced spherical k-means at Qwen3-30B-A3B's signature shape.

Synthetic signatures shaped like Qwen3-30B-A3B's (48 MoE layers x 128 experts, top-8): requests
from a dozen domains of unequal size, each domain preferring its own experts per layer, with
per-request noise; counts x IDF, flattened, L2-normalised (the real ``SignatureTransform``).
Printed, all in this one process:

1. fit time (k-means++ init + Lloyd iterations with the exact balanced assignment) at K=16 for
   10k, 100k and 1M signatures (goals: 100k within 60 s, 1M within 10 min on 2 cores);
2. against the ``k-means-constrained`` package (min-cost flow per iteration) on 5,000
   signatures: objective and time of both (goal: objective no worse, at least 10x faster).

Memory, honestly: 1M x 6144 float32 is 24.6 GB (12.3 GB as float16), more than this 23 GB
machine can spare. 10k and 100k use every layer (D = 6144). The 1M run uses a 12-layer mask
(D = 1536, 6.1 GB float32) -- ELDR clusters masked signatures, so this is the shape the fit
really sees when the mask keeps a quarter of the layers; per-iteration cost is linear in D.
The k-means code streams row blocks and also takes float16 or a memory map for larger data.

Timings are wall clock on whatever else the machine is running; ``cpu s`` (process CPU time,
all threads) shows how much of it this process actually got.

Usage: python examples/bench_fit.py [--sizes 10000,100000,1000000] [--skip-compare]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from stages.fit.kmeans import balanced_spherical_kmeans, cluster_sums
from stages.signature.transform import SignatureTransform, fit_idf

LAYERS, EXPERTS, TOP_K = 48, 128, 8
DOMAINS = 12
BLOCK = 4096  # requests generated per block


@dataclass(frozen=True)
class SyntheticModel:
    """Per-domain expert preferences; a request draws roughly tokens*top_k picks per layer."""

    profiles: np.ndarray  # float32 [DOMAINS, L, E], rows sum to 1
    weights: np.ndarray  # [DOMAINS] domain frequencies (unequal, as real traffic)

    @classmethod
    def make(cls, seed: int) -> SyntheticModel:
        rng = np.random.default_rng(seed)
        shared = rng.dirichlet(np.full(EXPERTS, 0.5), size=LAYERS)  # experts every domain uses
        own = rng.dirichlet(np.full(EXPERTS, 0.1), size=(DOMAINS, LAYERS))
        profiles = 0.5 * shared[None] + 0.5 * own
        weights = rng.dirichlet(np.full(DOMAINS, 2.0))
        return cls(profiles.astype(np.float32), weights)

    def counts(
        self, rng: np.random.Generator, n: int, layers: np.ndarray | None = None
    ) -> np.ndarray:
        """int32 [n, layers, E] prefill counts (Gaussian approximation of the multinomial)."""
        profiles = self.profiles if layers is None else self.profiles[:, layers]
        domain = rng.choice(DOMAINS, size=n, p=self.weights)
        tokens = rng.integers(16, 512, size=n).astype(np.float32)
        mean = profiles[domain] * (tokens * TOP_K)[:, None, None]
        noise = rng.standard_normal(mean.shape, dtype=np.float32)
        return np.maximum(np.rint(mean + np.sqrt(mean) * noise * 1.5), 0).astype(np.int32)


def masked_transform(idf: np.ndarray, layers: np.ndarray) -> SignatureTransform:
    """The transform restricted to ``layers``: same vectors as masking the full one, but the
    generator then only has to draw the kept layers' counts."""
    return SignatureTransform(idf=idf[layers], layer_mask=np.ones(len(layers), bool))


def signatures(
    model: SyntheticModel, idf: np.ndarray, layers: np.ndarray, n: int, seed: int
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    transform = masked_transform(idf, layers)
    out = np.empty((n, transform.dim), np.float32)
    for a in range(0, n, BLOCK):
        out[a : a + BLOCK] = transform.apply(model.counts(rng, min(BLOCK, n - a), layers))
    return out


def cosine_objective(x: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Best spherical objective of a labelling: sum_k |sum of cluster k| (unit-sum centroids)."""
    return float(np.linalg.norm(cluster_sums(x, labels, k), axis=1).sum())


def balanced_ok(labels: np.ndarray, k: int) -> bool:
    sizes = np.bincount(labels, minlength=k)
    return int(sizes.max() - sizes.min()) <= 1


def bench_sizes(args: argparse.Namespace, model: SyntheticModel, idf: np.ndarray) -> None:
    every_layer = np.arange(LAYERS)
    quarter = np.flatnonzero(np.arange(LAYERS) % 4 == 1)  # 12 of 48 layers
    print(f"\n== fit time, K={args.k}, balanced, max_iter={args.max_iter} ==")
    print(
        f"{'N':>9} {'D':>5} {'GB':>5} {'gen s':>7} {'fit s':>7} {'cpu s':>7} {'iters':>5}"
        f" {'s/iter':>7}"
        f" {'balanced':>8} {'gap bound':>10} {'mean cos':>8}  goal"
    )
    goals = {100_000: 60.0, 1_000_000: 600.0}
    for n in args.sizes:
        layers = every_layer if n <= 100_000 else quarter
        t0 = time.perf_counter()
        x = signatures(model, idf, layers, n, seed=args.seed + n)
        gen = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.process_time()
        res = balanced_spherical_kmeans(x, args.k, seed=args.seed, max_iter=args.max_iter)
        fit, cpu = time.perf_counter() - t0, time.process_time() - c0
        goal = goals.get(n)
        verdict = "" if goal is None else f"<= {goal:.0f} s: {'met' if fit <= goal else 'MISSED'}"
        print(
            f"{n:>9} {x.shape[1]:>5} {x.nbytes / 1e9:>5.1f} {gen:>7.1f} {fit:>7.1f} {cpu:>7.1f}"
            f" {res.iterations:>5} {fit / res.iterations:>7.2f}"
            f" {'yes' if balanced_ok(res.labels, args.k) else 'NO':>8}"
            f" {res.assignment_gap:>10.2e} {res.objective / n:>8.4f}  {verdict}",
            flush=True,
        )
        del x


def bench_compare(args: argparse.Namespace, model: SyntheticModel, idf: np.ndarray) -> None:
    from k_means_constrained import KMeansConstrained

    n, k = args.compare_n, args.k
    x = signatures(model, idf, np.arange(LAYERS), n, seed=args.seed + 7)
    sizes = f"{n // k}-{-(-n // k)}"
    print(f"\n== vs k-means-constrained, N={n}, D={x.shape[1]}, K={k}, sizes {sizes} ==")
    print("objective = sum of cosine similarity to the (re-normalised) cluster centroid")
    t0 = time.perf_counter()
    ours = balanced_spherical_kmeans(x, k, seed=args.seed, max_iter=args.max_iter)
    ours_s = time.perf_counter() - t0
    rows = [("eldr balanced_spherical_kmeans", ours_s, ours.objective, ours.labels, 1)]
    for n_init in args.kmc_n_init:
        t0 = time.perf_counter()
        kmc = KMeansConstrained(
            n_clusters=k,
            size_min=n // k,
            size_max=-(-n // k),
            n_init=n_init,
            random_state=args.seed,
        ).fit(x)
        kmc_s = time.perf_counter() - t0
        labels = np.asarray(kmc.labels_, dtype=np.int64)
        rows.append(
            (
                f"k-means-constrained n_init={n_init}",
                kmc_s,
                cosine_objective(x, labels, k),
                labels,
                n_init,
            )
        )
    print(f"{'method':<38} {'time s':>8} {'objective':>11} {'mean cos':>8} {'balanced':>8}")
    for name, secs, obj, labels, _ in rows:
        print(
            f"{name:<38} {secs:>8.2f} {obj:>11.3f} {obj / n:>8.5f}"
            f" {'yes' if balanced_ok(labels, k) else 'NO':>8}"
        )
    for name, secs, obj, _, _ in rows[1:]:
        print(
            f"vs {name}: speed-up {secs / ours_s:.1f}x (goal >= 10x), objective "
            f"{'no worse' if ours.objective >= obj - 1e-6 * abs(obj) else 'WORSE'} "
            f"({ours.objective - obj:+.3f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes",
        default="10000,100000,1000000",
        type=lambda s: [int(v) for v in s.split(",") if v],
    )
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-iter", type=int, default=50)
    parser.add_argument("--compare-n", type=int, default=5000)
    parser.add_argument(
        "--kmc-n-init",
        default="1",
        type=lambda s: [int(v) for v in s.split(",") if v],
        help="n_init values for k-means-constrained (its own default, 10, costs 10x n_init=1)",
    )
    parser.add_argument("--skip-compare", action="store_true")
    args = parser.parse_args()

    model = SyntheticModel.make(args.seed)
    # IDF from a 2,000-request calibration sample, as `eldr fit` would compute it.
    idf = fit_idf(model.counts(np.random.default_rng(args.seed), 2000))
    print(
        f"synthetic Qwen3-30B-A3B-shaped signatures: L={LAYERS}, E={EXPERTS}, top-{TOP_K},"
        f" {DOMAINS} domains of unequal size"
    )
    if not args.skip_compare:
        bench_compare(args, model, idf)
    bench_sizes(args, model, idf)


if __name__ == "__main__":
    main()
