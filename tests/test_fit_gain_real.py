"""`eldr fit`'s expected gain on a real capture of the bundled model (vLLM, the bundled
calibration prompts): a gain whose interval excludes zero, and none once each request's decode
profile is swapped for another request's, which leaves prefill predicting nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stages.fit.artifact import ArtifactStore
from stages.fit.gain_report import gain_lines
from stages.fit.pipeline import FitConfig, fit_artifact
from stages.routing.cost_model import gpu_like
from stages.signature.dataset import SignatureDataset
from tests.conftest import home_with, requires_vllm
from tests.proc_probe import eldr_ok
from tests.test_fit_gain import estimated

pytestmark = [requires_vllm, pytest.mark.vllm]


@pytest.fixture(scope="module")
def home(calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared calibration capture (400 prompts: 80 held out, enough for batches of 4 to 16
    on two clusters)."""
    return home_with(calibration, tmp_path_factory.mktemp("gain-real"))


def test_the_bundled_capture_gives_a_gain_whose_interval_excludes_zero(home: Path) -> None:
    out = eldr_ok("fit", "--k", "2", "--balanced", "--no-plot", home=home, timeout=900)
    gain = ArtifactStore(home / "artifacts").load().metrics["expected_gain"]
    rows = estimated(gain)
    assert [r["batch_size"] for r in rows][:2] == [4, 8], gain
    for row in rows:
        lo, hi = row["change_ci"]
        assert lo <= row["change"] <= hi < 0 and row["verdict"] == "gain", row
        assert row["tpot_change_ci"][1] < 0, row
        assert row["same_cluster_batches"] >= 1000 and row["random_batches"] >= 1000
    assert gain["verdict"] == "gain"
    assert "verdict: expected gain" in out
    # Every captured prompt is found in the bundled file by id and sha256, and the tiny
    # model's tokenizer makes the token counts vLLM prefilled: the arrival figure is measured.
    arrival = gain["arrival"]
    assert "skipped" not in arrival, arrival
    assert [r["batch_size"] for r in arrival["batches"]] == [r["batch_size"]
                                                              for r in gain["batches"]]
    assert all("arrival_change" in r for r in arrival["batches"] if "change" in r)
    assert "signature at arrival (token predictor" in out
    assert ArtifactStore(home / "artifacts").load().token_predictor is not None


def test_the_bundled_capture_with_shuffled_decode_profiles_gives_none(
    home: Path, tmp_path: Path
) -> None:
    dataset = SignatureDataset.open(home / "signatures.zarr")
    arrays = dataset.read()
    identity = dataset.identity
    shuffled = arrays.decode_counts[np.random.default_rng(0).permutation(len(arrays))]
    artifact = fit_artifact(
        arrays.prefill_counts, shuffled, identity, dataset.content_hash(),
        FitConfig(k=2, seed=0), ArtifactStore(tmp_path),
        cost=gpu_like(identity.num_layers, identity.num_experts),
    )
    gain = artifact.metrics["expected_gain"]
    rows = estimated(gain)
    assert rows
    for row in rows:
        lo, hi = row["change_ci"]
        assert lo < 0 < hi and row["verdict"] == "none", row
    assert gain["verdict"] == "none"
    assert gain_lines(gain, k=2)[-1].startswith("verdict: no expected gain")
