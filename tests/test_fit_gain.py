"""The fit's per-step gain estimate: no gain without locality, a clear one with it, the true
gain inside its interval at every batch size, the K warning, and the words that go with
them."""

from __future__ import annotations

import itertools
from math import comb
from pathlib import Path

import numpy as np
import pytest

from stages.errors import EldrError
from stages.fit.artifact import ArtifactStore
from stages.fit.batch_union import batch_union
from stages.fit.gain import (
    GainConfig,
    batch_verdict,
    estimate_gain,
    overall_verdict,
    parse_batch_sizes,
)
from stages.fit.gain_report import BALANCERS, LOCALITY_POLICIES, gain_lines, verdict_line
from stages.fit.pipeline import FitConfig, fit_artifact, held_out_rows, step_profiles
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


# -- a dataset whose true per-step gain is known ------------------------------------------------


def top2_inclusion(p: np.ndarray) -> np.ndarray:
    """P(expert e is one of a token's two picks), drawn without replacement from ``p``
    (``[..., E]``): e first, or j first and then e from the rest, which sums to
    ``p_e (1 + sum_{j != e} p_j / (1 - p_j))``."""
    odds = p / (1.0 - p)
    return p * (1.0 + odds.sum(axis=-1, keepdims=True) - odds)


def top2_counts(rng: np.random.Generator, p: np.ndarray, tokens: int) -> np.ndarray:
    """``[n, L, E]`` counts of ``tokens`` tokens per request, each picking two experts per layer
    without replacement from the request's ``p`` (``[n, L, E]``): the two largest of
    log p + Gumbel noise, which is exactly that draw."""
    keys = np.log(p)[:, None] + rng.gumbel(size=(len(p), tokens, *p.shape[1:]))
    picks = np.argpartition(-keys, 1, axis=-1)[..., :2]  # [n, T, L, 2]
    chosen = (picks[..., None] == np.arange(p.shape[-1])).any(axis=-2)  # [n, T, L, E]
    return chosen.sum(axis=1).astype(np.int32)


def latent_clusters(
    seed: int, n: int, local: bool, clusters: int = 4
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prefill, decode, pi): ``clusters`` latent clusters of n / clusters requests, each with
    its own expert distribution per layer. Prefill draws from the request's cluster (so
    clustering can recover it); decode from the same cluster when ``local``, else from a
    cluster drawn independently of it. ``pi``: ``[clusters, L, E]`` each cluster's per-token
    inclusion probability, which a request's decode profile estimates without bias."""
    rng = np.random.default_rng(seed)
    shape = (clusters, IDENTITY.num_layers)
    p = 0.9 * rng.dirichlet(np.full(IDENTITY.num_experts, 0.3), size=shape)
    p += 0.1 / IDENTITY.num_experts
    cluster = rng.permutation(np.arange(n) % clusters)
    decode_cluster = cluster if local else rng.integers(0, clusters, n)
    prefill = top2_counts(rng, p[cluster], tokens=24)
    decode = top2_counts(rng, p[decode_cluster], tokens=32)
    return prefill, decode, top2_inclusion(p)


def true_step_experts(pi: np.ndarray, members: int, batch: int) -> tuple[float, float]:
    """(same-cluster, random) expected distinct experts per layer of one decode step, for the
    local dataset of ``latent_clusters`` with ``members`` requests per cluster.

    A request's decode profile has mean pi_c and requests are independent, so a batch misses
    (l, e) with probability prod over its requests of (1 - pi_c). Same cluster: every batch of
    B of cluster c, (1 - pi_c)^B; clusters weigh equally. Random: a batch of B distinct
    requests of the whole pool holds j_c of cluster c with probability prod_c C(m, j_c) /
    C(n, B), so the mean miss is the coefficient of t^B in prod_c sum_j C(m, j) ((1 - pi_c)
    t)^j, over C(n, B).
    """
    q = 1.0 - pi.reshape(len(pi), -1)
    num_layers = pi.shape[1]
    same = float((1.0 - q**batch).sum(axis=1).mean() / num_layers)
    poly = np.zeros((batch + 1, q.shape[1]))
    poly[0] = 1.0
    for qc in q:
        term = np.stack([comb(members, j) * qc**j for j in range(batch + 1)])
        poly = np.stack([
            sum(poly[i] * term[j - i] for i in range(j + 1)) for j in range(batch + 1)
        ])
    miss = poly[batch] / comb(members * len(q), batch)
    return same, float((1.0 - miss).sum() / num_layers)


def test_true_step_experts_matches_sampling() -> None:
    """The closed form the next test holds the estimate to, against batches drawn at random."""
    rng = np.random.default_rng(0)
    pi = top2_inclusion(rng.dirichlet(np.full(8, 0.5), size=(3, 2)))
    same, rand = true_step_experts(pi, members=5, batch=4)
    cluster = np.repeat(np.arange(3), 5)
    draws = {"same": [], "random": []}
    for _ in range(20000):
        for arm, pool in (("same", np.flatnonzero(cluster == rng.integers(3))),
                          ("random", np.arange(15))):
            batch = cluster[rng.choice(pool, 4, replace=False)]
            draws[arm].append((1.0 - np.prod(1.0 - pi[batch], axis=0)).sum() / 2)
    assert np.mean(draws["same"]) == pytest.approx(same, abs=0.02)
    assert np.mean(draws["random"]) == pytest.approx(rand, abs=0.02)
    assert same < rand


@pytest.mark.parametrize("local", [True, False], ids=["locality", "independent-decode"])
def test_cross_fit_verdict_and_interval_hold_the_truth_at_every_batch_size(
    tmp_path: Path, local: bool
) -> None:
    """320 requests in 4 latent clusters: every batch size estimated, each verdict right, and
    the interval covers the true change (zero where decode ignores the cluster)."""
    prefill, decode, pi = latent_clusters(seed=0, n=320, local=local)
    gain = fitted_gain(prefill, decode, tmp_path)["expected_gain"]
    assert gain["method"] == "cross-fit" and gain["folds"] == 5
    assert gain["label_agreement"] > 0.99  # the folds found the artifact's clusters
    rows = {row["batch_size"]: row for row in gain["batches"]}
    assert sorted(rows) == [4, 8, 16, 32] and all("change" in r for r in rows.values())
    for batch, row in rows.items():
        same, rand = true_step_experts(pi, members=80, batch=batch)
        truth = same / rand - 1.0 if local else 0.0
        lo, hi = row["change_ci"]
        assert lo <= truth <= hi, (batch, truth, row)
        if local:
            assert truth < -0.1
            tpot = float(COST.step_time(batch, np.array([same]))[0]
                         / COST.step_time(batch, np.array([rand]))[0]) - 1.0
            assert row["tpot_change_ci"][0] <= tpot <= row["tpot_change_ci"][1]
        assert row["verdict"] == ("gain" if local else "none"), row
    assert gain["verdict"] == ("gain" if local else "none")
    verdict = gain_lines(gain, k=4)[-1]
    assert "at batch 4, 8, 16 and 32" in verdict and "not estimated" not in verdict


def test_a_dataset_whose_held_out_split_misses_batch_16_now_estimates_it(
    tmp_path: Path
) -> None:
    """The same 320 requests: the held-out fifth (64, 16 a cluster) cannot make batches of 16
    (clusters of 32), so the old estimate stopped at 8; the cross-fit has 80 a cluster."""
    prefill, decode, _ = latent_clusters(seed=0, n=320, local=True)
    config = FitConfig(k=4, seed=1, num_pairs=3000, gain=GainConfig(num_resamples=1000))
    artifact = fit_artifact(
        prefill, decode, IDENTITY, "d" * 64, config, ArtifactStore(tmp_path), cost=COST
    )
    held = held_out_rows(artifact.params, len(prefill))
    assert held is not None and len(held) == 64
    split = estimate_gain(
        artifact.transform.apply(prefill[held]), artifact.centroids,
        step_profiles(prefill[held], decode[held], IDENTITY), IDENTITY.num_layers,
        config.gain, np.random.default_rng(0), COST,
    )
    before = {row["batch_size"]: row for row in split["batches"]}
    assert "skipped" in before[16] and "skipped" in before[32]
    assert "not estimated at 16: clusters with at least 32 requests hold" in verdict_line(split)
    after = {row["batch_size"]: row for row in artifact.metrics["expected_gain"]["batches"]}
    assert after[16]["verdict"] == after[32]["verdict"] == "gain"
    # The artifact itself is still fit on its training split only.
    assert artifact.params["num_train"] == sum(artifact.metrics["cluster_sizes"]) == 256


def _row(batch: int, verdict: str, change: float) -> dict:  # type: ignore[type-arg]
    """An estimated row as ``estimate_gain`` stores it."""
    return {
        "batch_size": batch, "clusters": 4, "requests": 160, "same_cluster_batches": 5e6,
        "random_batches": 4e8, "same_cluster_distinct_experts_per_layer": 20.0 * (1 + change),
        "random_distinct_experts_per_layer": 20.0, "change": change,
        "change_ci": [change - 0.01, change + 0.01], "tpot_change": change / 2,
        "tpot_change_ci": [change / 2 - 0.01, change / 2 + 0.01], "verdict": verdict,
    }


@pytest.mark.parametrize(
    ("verdicts", "overall", "start"),
    [
        (("gain", "gain"), "gain",
         "verdict: expected gain at batch 8 and 16 (-2.1%, -2.9% TPOT with the gpu-like cost"
         " model; -4.2%, -5.8% distinct experts per step)"),
        (("none", "negligible"), "negligible",
         "verdict: gain too small to matter at batch 16 (-2.9% TPOT"),
        (("none", "none"), "none", "verdict: no expected gain at batch 8 and 16: every"),
        (("gain", "worse"), "mixed",
         "verdict: no expected gain: same-cluster batches use more distinct experts at batch"
         " 16"),
        ((None, None), "unknown", "verdict: cannot tell"),
    ],
)
def test_every_verdict_names_its_batch_sizes_and_what_was_not_estimated(
    verdicts: tuple[str | None, str | None], overall: str, start: str
) -> None:
    rows: list[dict] = [  # type: ignore[type-arg]
        _row(b, v, c) if v else {"batch_size": b, "skipped": "fewer than 1000 distinct batches"}
        for b, v, c in zip((8, 16), verdicts, (-0.042, -0.058), strict=True)
    ]
    rows.append({"batch_size": 32, "skipped": "clusters with at least 64 requests hold 35 of 169"
                 " (need at least 50%)"})
    gain = {"verdict": overall, "batches": rows, "cost_model": "gpu-like"}
    line = verdict_line(gain)
    assert line.startswith(start), line
    assert "not estimated at " in line
    assert "32: clusters with at least 64 requests hold 35 of 169 (need at least 50%)" in line


def test_a_gain_stored_before_the_cross_fit_still_reads() -> None:
    """Artifacts fit before the cross-fit carry no method or folds: their estimate was on the
    held-out split, and says so."""
    gain = {"num_holdout": 169, "confidence": 0.95, "num_resamples": 2000,
            "cost_model": "gpu-like", "verdict": "gain",
            "batches": [_row(4, "gain", -0.05), {"batch_size": 8, "skipped": "few"}]}
    lines = gain_lines(gain, k=16)
    assert "on 169 held-out requests' decode profiles" in lines[0]
    assert not any("note:" in line for line in lines)
    assert lines[-1].startswith("verdict: expected gain at batch 4 (-2.5% TPOT")
    assert "not estimated at 8: few" in lines[-1]


def test_unstable_clusters_are_named() -> None:
    """Folds that split the requests otherwise than the artifact: said above the verdict."""
    gain = {"method": "cross-fit", "folds": 5, "label_agreement": 0.57, "num_holdout": 843,
            "confidence": 0.95, "num_resamples": 2000, "cost_model": "gpu-like",
            "verdict": "gain", "batches": [_row(8, "gain", -0.05)]}
    lines = gain_lines(gain, k=16)
    assert "5-fold cross-fit" in lines[0] and "57% of the labels" in lines[0]
    assert lines[-2].startswith("  note: only 57% of the out-of-fold labels")
    assert gain_lines(gain | {"label_agreement": 0.95}, k=16)[-2].startswith("      8")


def test_parse_batch_sizes() -> None:
    assert parse_batch_sizes("8,16,32") == (8, 16, 32)
    assert parse_batch_sizes(" 16, 8,16 ") == (8, 16)
    for bad, match in (("0", "positive"), ("x", "not a decode batch size"),
                       ("", "at least one"), ("8,,16", "not a decode batch size"),
                       ("-4", "positive")):
        with pytest.raises(EldrError, match=match):
            parse_batch_sizes(bad)


def estimated(gain: dict) -> list[dict]:  # type: ignore[type-arg]
    return [row for row in gain["batches"] if "change" in row]


def test_shuffled_decode_profiles_give_no_expected_gain(tmp_path: Path) -> None:
    """Each request's decode profile swapped with another's: prefill predicts nothing."""
    prefill, decode = domain_counts(seed=0)
    shuffled = decode[np.random.default_rng(5).permutation(len(decode))]
    metrics = fitted_gain(prefill, shuffled, tmp_path)
    gain = metrics["expected_gain"]
    rows = estimated(gain)
    # Every request, out of fold (the held-out split's 120 reached batch 8 only): 600 in 4
    # clusters, and a batch of 32 needs clusters of 64.
    assert gain["method"] == "cross-fit" and gain["folds"] == 5 and gain["num_holdout"] == 600
    assert [r["batch_size"] for r in rows] == [4, 8, 16, 32]
    for row in rows:
        lo, hi = row["change_ci"]
        assert lo < 0 < hi and row["verdict"] == "none"
        assert row["tpot_change_ci"][0] < 0 < row["tpot_change_ci"][1]
        assert row["same_cluster_batches"] >= 1000 and row["random_batches"] >= 1000
    assert gain["verdict"] == "none"
    lines = gain_lines(gain, k=4)
    assert lines[-1].startswith("verdict: no expected gain at batch 4, 8, 16 and 32")
    assert "--policy jsq" in lines[-1] and "rr" in lines[-1]
    assert not any("not estimated" in line for line in lines)


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
