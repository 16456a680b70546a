"""`eldr fit` prints the held-out gain, its TPOT change and a verdict; `eldr artifacts show
--gain` prints the same from the artifact. Real fits on small synthetic datasets (seconds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from eldr_cli.app import app
from stages.fit.artifact import ArtifactStore
from stages.signature.dataset import CaptureRecord, SignatureDataset
from tests.test_fit_gain import IDENTITY, domain_counts

runner = CliRunner()


def write_dataset(path: Path, prefill: np.ndarray, decode: np.ndarray) -> Path:
    dataset = SignatureDataset.create_or_open(path, IDENTITY, vllm_version="test")
    dataset.append([
        CaptureRecord(
            id=f"r{i}", domain="d", prompt_sha256="", prompt_tokens=int(p.sum() // 2),
            output_tokens=int(d.sum() // 2), prefill_counts=p, decode_counts=d,
        )
        for i, (p, d) in enumerate(zip(prefill, decode, strict=True))
    ])
    return path


def fit(tmp_path: Path, data: Path, k: int) -> str:
    result = runner.invoke(app, [
        "fit", "--k", str(k), "--data", str(data), "--store", str(tmp_path / "artifacts"),
        "--no-plot",
    ])
    assert result.exit_code == 0, result.output
    return result.output


def test_fit_prints_gain_tpot_and_verdict(tmp_path: Path) -> None:
    prefill, decode = domain_counts(seed=0)
    out = fit(tmp_path, write_dataset(tmp_path / "sig.zarr", prefill, decode), k=4)
    # Cross-fit: all 600 requests, so batches of 16 and 32 too (120 held out reached 8).
    assert ("expected per-step gain of routing by centroid (k=4), on all 600 requests' decode"
            " profiles, each labelled by centroids fit without it (5-fold cross-fit") in out
    assert "TPOT from the gpu-like cost model (--cost gpu, the preset `eldr bench" in out
    rows = [line.split() for line in out.splitlines()
            if line.split()[:1] in (["4"], ["8"], ["16"], ["32"])]
    assert [r[0] for r in rows] == ["4", "8", "16", "32"] and all(r[-1] == "gain" for r in rows)
    assert "verdict: expected gain at batch 4, 8, 16 and 32 (" in out and "warning:" not in out

    shown = runner.invoke(app, ["artifacts", "show", "--gain", "--store",
                                str(tmp_path / "artifacts")])
    assert shown.exit_code == 0, shown.output
    gain_part = out[out.index("expected per-step gain"):].splitlines()
    assert shown.output.splitlines() == gain_part


def test_fit_on_shuffled_decode_says_use_a_balancer(tmp_path: Path) -> None:
    prefill, decode = domain_counts(seed=0)
    shuffled = decode[np.random.default_rng(5).permutation(len(decode))]
    out = fit(tmp_path, write_dataset(tmp_path / "sig.zarr", prefill, shuffled), k=4)
    assert "within noise" in out
    assert "verdict: no expected gain" in out and "--policy jsq" in out


def test_fit_warns_when_k_is_large_for_the_data(tmp_path: Path) -> None:
    prefill, decode = domain_counts(seed=3, n=40)
    out = fit(tmp_path, write_dataset(tmp_path / "sig.zarr", prefill, decode), k=20)
    assert "warning: k=20 is large for 32 training signatures: 1.6 per cluster" in out
    assert "verdict: cannot tell" in out


def test_fit_with_cpu_cost_names_it(tmp_path: Path) -> None:
    prefill, decode = domain_counts(seed=0)
    data = write_dataset(tmp_path / "sig.zarr", prefill, decode)
    result = runner.invoke(app, ["fit", "--k", "4", "--data", str(data), "--store",
                                 str(tmp_path / "a"), "--no-plot", "--cost", "cpu"])
    assert result.exit_code == 0, result.output
    assert "TPOT from the cpu-like cost model (--cost cpu)" in result.output


def test_fit_estimates_the_decode_batches_asked_for(tmp_path: Path) -> None:
    prefill, decode = domain_counts(seed=0)
    data = write_dataset(tmp_path / "sig.zarr", prefill, decode)
    result = runner.invoke(app, ["fit", "--k", "4", "--data", str(data), "--store",
                                 str(tmp_path / "a"), "--no-plot", "--decode-batch", "16, 8"])
    assert result.exit_code == 0, result.output
    rows = [line.split()[0] for line in result.output.splitlines()
            if line.split()[:1] in (["4"], ["8"], ["16"], ["32"])]
    assert rows == ["8", "16"]
    assert "verdict: expected gain at batch 8 and 16 (" in result.output
    assert ArtifactStore(tmp_path / "a").load().params["gain"]["batch_sizes"] == [8, 16]


@pytest.mark.parametrize(
    ("value", "why"),
    [("0", "must be positive"), ("x", "'x' is not a decode batch size"),
     ("", "at least one decode batch size")],
)
def test_a_bad_decode_batch_is_a_usage_error(tmp_path: Path, value: str, why: str) -> None:
    """Refused before anything is read (the dataset does not exist), exit 2, no traceback."""
    result = runner.invoke(app, ["fit", "--data", str(tmp_path / "none.zarr"), "--no-plot",
                                 "--decode-batch", value])
    assert result.exit_code == 2, result.output
    # Typer may draw the message in a box, wrapped to the terminal's width.
    said = " ".join(result.output.replace("│", " ").split())
    assert "Invalid value for '--decode-batch'" in said and why in said
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
