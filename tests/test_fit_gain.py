"""The fit's held-out gain estimate: no gain without locality, a clear one with it, the K
warning, and the words that go with them."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from stages.fit.artifact import ArtifactStore
from stages.fit.batch_union import batch_union
from stages.fit.gain import GainConfig, batch_verdict, estimate_gain, overall_verdict
from stages.fit.gain_report import BALANCERS, LOCALITY_POLICIES, gain_lines
from stages.fit.pipeline import FitConfig, fit_artifact
from stages.routing.cost_model import gpu_like
from stages.routing.policies import POLICIES
from stages.signature.dataset import ModelIdentity
from stages.signature.inclusion import inclusion_log_complement

IDENTITY = ModelIdentity(name="tiny-moe", num_layers=6, num_experts=16, top_k=2)
COST = gpu_like(IDENTITY.num_layers, IDENTITY.num_experts)


def domain_counts(
    seed: int, n: int = 600, domains: int = 4, weight: float = 0.7
) -> tuple[np.ndarray, np.ndarray]:
    """Each domain favours a few experts per layer in prefill and decode alike; a request
    mixes that with its own preference (``weight`` is the domain's share)."""
    rng = np.random.default_rng(seed)
    domain = rng.integers(0, domains, n)
    profiles = rng.dirichlet(np.full(16, 0.15), size=(domains, 6))
    own = rng.dirichlet(np.full(16, 0.5), size=(n, 6))
    probs = weight * profiles[domain] + (1 - weight) * own
    prefill = rng.multinomial(rng.integers(10, 40, n)[:, None] * 2, probs)
    decode = rng.multinomial(rng.integers(8, 64, n)[:, None] * 2, probs)
    return prefill.astype(np.int32), decode.astype(np.int32)


def fitted_gain(
    prefill: np.ndarray, decode: np.ndarray, tmp_path: Path, k: int = 4
) -> dict:  # type: ignore[type-arg]
    config = FitConfig(k=k, seed=1, num_pairs=3000, gain=GainConfig(num_resamples=1000))
    artifact = fit_artifact(
        prefill, decode, IDENTITY, "d" * 64, config, ArtifactStore(tmp_path), cost=COST
    )
    return artifact.metrics


def estimated(gain: dict) -> list[dict]:  # type: ignore[type-arg]
    return [row for row in gain["batches"] if "change" in row]


def test_shuffled_decode_profiles_give_no_expected_gain(tmp_path: Path) -> None:
    """Each request's decode profile swapped with another's: prefill predicts nothing."""
    prefill, decode = domain_counts(seed=0)
    shuffled = decode[np.random.default_rng(5).permutation(len(decode))]
    metrics = fitted_gain(prefill, shuffled, tmp_path)
    gain = metrics["expected_gain"]
    rows = estimated(gain)
    # 120 held-out requests in 4 clusters: a batch of 16 needs clusters of 32.
    assert [r["batch_size"] for r in rows] == [4, 8]
    for row in rows:
        lo, hi = row["change_ci"]
        assert lo < 0 < hi and row["verdict"] == "none"
        assert row["tpot_change_ci"][0] < 0 < row["tpot_change_ci"][1]
        assert row["same_cluster_batches"] >= 1000 and row["random_batches"] >= 1000
    assert gain["verdict"] == "none"
    lines = gain_lines(gain, k=4)
    assert lines[-1].startswith("verdict: no expected gain")
    assert "--policy jsq" in lines[-1] and "rr" in lines[-1]
    skipped = [line.split()[0] for line in lines if "not estimated" in line]
    assert skipped == ["16", "32"]


def test_real_locality_gives_a_gain_whose_interval_excludes_zero(tmp_path: Path) -> None:
    prefill, decode = domain_counts(seed=0)
    gain = fitted_gain(prefill, decode, tmp_path)["expected_gain"]
    rows = estimated(gain)
    assert rows
    for row in rows:
        lo, hi = row["change_ci"]
        assert lo <= row["change"] <= hi < 0
        assert row["tpot_change_ci"][1] < 0 and row["verdict"] == "gain"
        assert (
            row["same_cluster_distinct_experts_per_layer"]
            < row["random_distinct_experts_per_layer"]
        )
    assert gain["verdict"] == "gain" and gain["cost_model"] == "gpu-like"
    verdict = gain_lines(gain, k=4)[-1]
    assert verdict.startswith("verdict: expected gain") and "--policy eldr" in verdict


def test_weak_locality_is_smaller_but_still_seen(tmp_path: Path) -> None:
    """A quarter of the picks follow the domain: a few percent, as real MoEs show."""
    prefill, decode = domain_counts(seed=2, n=1000, weight=0.25)
    gain = fitted_gain(prefill, decode, tmp_path)["expected_gain"]
    changes = [row["change"] for row in estimated(gain)]
    assert changes and all(-0.15 < c < 0 for c in changes)


def test_large_k_warns(tmp_path: Path) -> None:
    """`eldr fit --k 20` on 40 signatures: clusters of 1-2 requests."""
    prefill, decode = domain_counts(seed=3, n=40)
    config = FitConfig(k=20, seed=0, num_pairs=500)
    artifact = fit_artifact(prefill, decode, IDENTITY, "e" * 64, config, ArtifactStore(tmp_path))
    [warning] = artifact.metrics["warnings"]
    assert "k=20 is large for 32 training signatures: 1.6 per cluster" in warning
    assert "capture at least 500 signatures" in warning and "k<=1" in warning
    gain = artifact.metrics["expected_gain"]
    assert gain["verdict"] == "unknown" and gain["cost_model"] is None
    assert gain_lines(gain, k=20)[-1].startswith("verdict: cannot tell")


def test_batch_union_is_the_mean_over_every_batch() -> None:
    rng = np.random.default_rng(0)
    logc = np.log1p(-0.9 * rng.random((9, 12)))  # 9 requests, L*E = 12, 3 layers
    unions = batch_union(logc, (1, 3, 4, 9), num_layers=3)
    for size, union in unions.items():
        value = {
            batch: float(-np.expm1(logc[list(batch)].sum(axis=0)).sum() / 3)
            for batch in itertools.combinations(range(9), size)
        }
        assert union.num_batches == len(value)
        assert union.mean == pytest.approx(np.mean(list(value.values())), abs=1e-12)
        for r in range(9):
            held = [v for batch, v in value.items() if r in batch]
            assert union.projection[r] == pytest.approx(np.mean(held), abs=1e-12)


def test_interval_narrows_with_more_held_out_requests() -> None:
    """The uncertainty is which requests were held out: four times as many, a far narrower
    interval (with no locality, by about four: the paired difference has no first-order term)."""
    widths = []
    for n in (200, 800):
        rng = np.random.default_rng(n)
        decode = rng.multinomial(40, rng.dirichlet(np.full(16, 0.3), size=(n, 2)))
        logc = np.stack([inclusion_log_complement(d, top_k=2) for d in decode])
        x = np.repeat(np.eye(2), n // 2, axis=0)  # two clusters, unrelated to decode
        gain = estimate_gain(x, np.eye(2), logc, 2, GainConfig(batch_sizes=(8,)),
                             np.random.default_rng(1))
        [row] = gain["batches"]
        assert row["change_ci"][0] < 0 < row["change_ci"][1]
        widths.append(row["change_ci"][1] - row["change_ci"][0])
    assert widths[1] < 0.5 * widths[0]


@pytest.mark.parametrize(
    ("ci", "tpot", "word"),
    [
        ([-0.1, 0.02], -0.05, "none"),
        ([-0.1, -0.02], -0.05, "gain"),
        ([-0.01, -0.001], -0.004, "negligible"),
        ([0.01, 0.03], 0.02, "worse"),
        ([-0.1, -0.02], None, "gain"),
    ],
)
def test_batch_verdicts(ci: list[float], tpot: float | None, word: str) -> None:
    assert batch_verdict(ci, tpot) == word


def test_overall_verdict() -> None:
    rows = [{"verdict": "gain"}, {"verdict": "none"}, {"batch_size": 32, "skipped": "few"}]
    assert overall_verdict(rows) == "gain"
    assert overall_verdict([{"verdict": "none"}, {"verdict": "negligible"}]) == "negligible"
    assert overall_verdict([{"verdict": "worse"}, {"verdict": "none"}]) == "worse"
    assert overall_verdict([{"skipped": "few"}]) == "unknown"


def test_advice_names_registered_policies() -> None:
    for name in BALANCERS + LOCALITY_POLICIES:
        assert name in POLICIES
