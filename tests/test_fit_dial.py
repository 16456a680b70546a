"""`eldr fit` places its data on the locality dial and simulates a cluster there: where the
data sits, the TPOT figure with its interval over seeds, and why the dial cannot place it when
it cannot. Real fits and simulations on small synthetic datasets (seconds, no vLLM)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from eldr_cli.app import app
from stages.bench.sim.fit_dial import (
    DialData,
    DialSettings,
    choose_dial_data,
    fit_dial,
    seed_interval,
)
from stages.errors import EldrError
from stages.fit.artifact import Artifact, ArtifactStore
from stages.fit.dial import dial_line
from stages.fit.gain import GainConfig
from stages.fit.pipeline import FitConfig, fit_artifact
from stages.routing.cost_model import CostModel
from stages.signature.dataset import ModelIdentity, SignatureDataset
from tests.conftest import write_dataset as write_arrays
from tests.test_fit_cli import write_dataset
from tests.test_fit_gain import COST, IDENTITY, domain_counts

runner = CliRunner()
CONFIG = FitConfig(k=4, seed=1, num_pairs=3000, gain=GainConfig(num_resamples=200))
# A cluster small and short enough for tests; its TPOT figures are not asserted.
SMALL = DialSettings(prefill=2, decode=4, requests=80, seeds=3, output_tokens=32)


def half_swapped(decode: np.ndarray) -> np.ndarray:
    """Half the requests decode as another request did (whole counts, so a dataset can hold
    them): data of the same model whose prefill predicts about half as much."""
    rng = np.random.default_rng(7)
    pick = rng.random(len(decode)) < 0.5
    out = decode.copy()
    out[pick] = decode[rng.permutation(len(decode))[pick]]
    return out


def fit_with_dial(
    path: Path, store: Path, data: DialData, settings: DialSettings = SMALL,
    cost: CostModel | None = COST, config: FitConfig = CONFIG,
) -> Artifact:
    """`eldr fit` of the dataset at ``path`` with its dial, as the CLI runs it."""
    dataset = SignatureDataset.open(path)
    arrays = dataset.read()
    dial = partial(fit_dial(data, settings), arrays)
    return fit_artifact(arrays.prefill_counts, arrays.decode_counts, IDENTITY,
                        dataset.content_hash(), config, ArtifactStore(store), cost=cost,
                        dial=dial)


def test_fit_prints_where_its_data_sits_and_the_simulated_tpot_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On its own data (no dataset at $ELDR_HOME) the fit is the dial's s = 0, and the
    simulated 8P16D cluster gives eldr-union's TPOT over the best balancer with an interval
    over five seeds, stored with the artifact and shown again by `eldr artifacts show`."""
    monkeypatch.setenv("ELDR_HOME", str(tmp_path / "home"))
    data = write_dataset(tmp_path / "sig.zarr", *domain_counts(seed=0))
    store = tmp_path / "artifacts"
    result = runner.invoke(app, ["fit", "--k", "4", "--data", str(data), "--store", str(store),
                                 "--no-plot"])
    assert result.exit_code == 0, result.output
    artifact = ArtifactStore(store).load()
    dial = artifact.metrics["dial"]
    batch4 = artifact.metrics["expected_gain"]["batches"][0]
    assert dial["own_data"] and dial["strength"] == 0.0 and dial["batch_size"] == 4
    assert dial["agreement"] == -batch4["change"] and dial["curve"] == []
    sim = dial["simulation"]
    assert sim["cluster"] == "8P16D" and sim["cost_model"] == "gpu-like" and sim["load"] == 0.5
    assert sim["seeds"] == [0, 1, 2, 3, 4] and sim["balancers"] == ["rr", "jsq", "random", "p2c"]
    for key in ("median_tpot_ms_over_best_balancer", "p99_tpot_ms_over_best_balancer"):
        figure = sim[key]
        assert len(figure["per_seed"]) == 5
        assert figure == seed_interval(figure["per_seed"], 0.95)
    # Strong locality: eldr-union beats the best balancer in every run.
    assert max(sim["median_tpot_ms_over_best_balancer"]["per_seed"]) < 0.97
    line = result.output.splitlines()[-1]
    assert line == dial_line(dial)
    assert line.startswith("dial: your data is the dial's s = 0 (the dial is built on it; 18.2%"
                           " fewer distinct experts per step at batch 4, cross-fit); the"
                           " simulated 8P16D cluster there (gpu-like cost, 50% of capacity,"
                           " 5 seeds x ~400 requests): eldr-union TPOT p50 0.9")
    assert "of the best load balancer (95% intervals over the seeds)" in line
    shown = runner.invoke(app, ["artifacts", "show", "--gain", "--store", str(store)])
    assert shown.exit_code == 0 and shown.output.splitlines()[-1] == line


def test_weaker_data_sits_inside_the_dial_of_stronger_data(tmp_path: Path) -> None:
    """Half the requests' decode swapped for another's sits near s = 0.5 on the dial of the
    data it came from; the dial starts at what `eldr fit` stores for that data and ends at no
    locality."""
    prefill, decode = domain_counts(seed=0)
    strong = write_dataset(tmp_path / "strong.zarr", prefill, decode)
    weak = write_dataset(tmp_path / "weak.zarr", prefill, half_swapped(decode))
    dial = fit_with_dial(weak, tmp_path / "weak", DialData(strong)).metrics["dial"]
    assert not dial["own_data"] and dial["data"] == str(strong) and dial["note"] == ""
    assert 0.35 < dial["strength"] < 0.6, dial["strength"]
    curve = [(c["strength"], c["reduction"]) for c in dial["curve"]]
    assert [s for s, _ in curve] == pytest.approx(np.linspace(0, 1, 21).tolist())
    own = fit_with_dial(strong, tmp_path / "strong", DialData(None)).metrics
    assert curve[0][1] == pytest.approx(-own["expected_gain"]["batches"][0]["change"], rel=1e-12)
    lo, hi = dial["curve"][-1]["interval"]
    assert lo <= 0.0 <= hi
    # The mark is where the curve falls to the weak data's own gain.
    strengths, reductions = zip(*curve, strict=True)
    assert np.interp(dial["strength"], strengths, reductions) == pytest.approx(dial["agreement"])
    assert dial["simulation"]["cluster"] == "2P4D" and len(dial["simulation"]["seeds"]) == 3
    assert dial_line(dial).startswith(
        f"dial: your data (5.4% fewer distinct experts per step at batch 4, cross-fit) sits at"
        f" s = {dial['strength']:.2f} on the dial of {strong}; the simulated 2P4D cluster there")


def test_the_dial_says_why_it_cannot_place_the_data(tmp_path: Path) -> None:
    few = write_dataset(tmp_path / "few.zarr", *domain_counts(seed=3, n=40))
    crowded = fit_with_dial(few, tmp_path / "a", DialData(None),
                            config=FitConfig(k=8, seed=1, num_pairs=3000))
    assert crowded.metrics["expected_gain"]["verdict"] == "unknown"
    assert dial_line(crowded.metrics["dial"]) == (
        "dial: cannot place your data: the fit estimated its gain at no batch size (see the"
        " verdict)")

    data = write_dataset(tmp_path / "sig.zarr", *domain_counts(seed=0))
    tiny = write_dataset(tmp_path / "tiny.zarr", *domain_counts(seed=1, n=6))
    small_dial = fit_with_dial(data, tmp_path / "b", DialData(tiny)).metrics["dial"]
    assert dial_line(small_dial) == (
        f"dial: cannot place your data: cannot fit the dial's data {tiny}: 6 signatures cannot"
        " make 4 clusters of two")

    no_cost = fit_with_dial(data, tmp_path / "c", DialData(None), cost=None).metrics["dial"]
    assert no_cost["strength"] == 0.0
    assert dial_line(no_cost).endswith(
        "; no simulated cluster: no step-time model for this model (pass --cost cpu or a fitted"
        " JSON)")


def test_the_dial_data_is_the_default_dataset_else_the_fits_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("ELDR_HOME", str(home))
    mine = write_dataset(tmp_path / "mine.zarr", *domain_counts(seed=0))
    assert choose_dial_data(mine, None) == DialData(None)  # nothing at $ELDR_HOME
    with pytest.raises(EldrError, match="no signature dataset at"):
        choose_dial_data(mine, tmp_path / "missing.zarr")

    bundled = write_dataset(home / "signatures.zarr", *domain_counts(seed=2))
    assert choose_dial_data(mine, None) == DialData(bundled)
    assert choose_dial_data(bundled, None) == DialData(None)  # fitting the default data itself

    other_model = ModelIdentity(name="other", num_layers=6, num_experts=16, top_k=4)
    other = tmp_path / "other.zarr"
    arrays = SignatureDataset.open(mine).read()
    write_arrays(other, arrays, other_model)
    with pytest.raises(EldrError, match=r"--dial-data: .* holds other \(L=6, E=16, top_k=4\)"
                       r" signatures .* gains of different models do not compare"):
        choose_dial_data(mine, other)
    fallback = choose_dial_data(other, None)
    assert fallback.path is None and "gains of different models do not compare" in fallback.note


def test_no_dial_stores_none_and_dial_data_needs_the_dial(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "sig.zarr", *domain_counts(seed=0))
    store = tmp_path / "artifacts"
    result = runner.invoke(app, ["fit", "--k", "4", "--data", str(data), "--store", str(store),
                                 "--no-plot", "--no-dial"])
    assert result.exit_code == 0, result.output
    assert "dial" not in ArtifactStore(store).load().metrics
    assert "dial:" not in result.output
    refused = runner.invoke(app, ["fit", "--data", str(data), "--no-dial", "--dial-data",
                                  str(data)])
    assert refused.exit_code == 2
    assert "--dial-data builds the dial: drop --no-dial" in " ".join(
        refused.output.replace("│", " ").split())


def test_an_interval_over_seeds_is_students_t() -> None:
    figure = seed_interval([1.0, 2.0, 3.0], 0.95)
    # Mean 2, standard deviation 1, t(0.975, 2 degrees of freedom) = 4.3027.
    assert figure["mean"] == 2.0
    assert figure["interval"] == pytest.approx([2.0 - 4.3027 / 3**0.5, 2.0 + 4.3027 / 3**0.5],
                                               abs=1e-4)
    with pytest.raises(EldrError, match="at least 2"):
        DialSettings(seeds=1)
