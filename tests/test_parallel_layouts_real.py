"""Parallel layouts that need several GPUs (run by scripts/gpu-check.sh where there are two):
pipeline parallel records every MoE layer, merged in layer order, as one engine does; data
parallel and dual-batch overlap are refused at start with the mode named. On CPU, PP is
refused (tests/test_engine_guards_real.py) and TP is tested in tests/test_capture_real.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import requires_vllm


def gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


pytestmark = [requires_vllm, pytest.mark.vllm]
two_gpus = pytest.mark.skipif(gpus() < 2, reason="needs two GPUs (scripts/gpu-check.sh)")


def capture(kwargs: dict[str, object], out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.layout_capture", json.dumps(kwargs),
                           str(out)], capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[1])


@pytest.mark.skipif(gpus() < 1, reason="needs a GPU (scripts/gpu-check.sh)")
def test_async_scheduling_stays_on_with_eldrs_connector(tmp_path: Path) -> None:
    run = capture({}, tmp_path / "one.npz")
    assert run.returncode == 0, run.stderr[-3000:]
    assert bool(np.load(tmp_path / "one.npz")["async_scheduling"])


@two_gpus
def test_pipeline_parallel_records_every_layer_like_one_engine(tmp_path: Path) -> None:
    results = {}
    for name, kwargs in (("pp1", {}), ("pp2", {"pipeline_parallel_size": 2})):
        run = capture(kwargs, tmp_path / f"{name}.npz")
        assert run.returncode == 0, run.stderr[-3000:]
        results[name] = np.load(tmp_path / f"{name}.npz")
    one, two = results["pp1"], results["pp2"]
    assert two["moe_layers"].tolist() == one["moe_layers"].tolist() == [0, 1, 2, 3]
    # Every prompt token counted once in every layer, the stages' rows in layer order.
    np.testing.assert_array_equal(two["signatures"].sum(2), one["signatures"].sum(2))
    moved = np.abs(one["signatures"].astype(int) - two["signatures"]).sum() / 2
    assert moved / one["signatures"].sum() < 0.01


@two_gpus
def test_expert_parallel_over_tensor_ranks_records_like_one_engine(tmp_path: Path) -> None:
    results = {}
    for name, kwargs in (("one", {}), ("ep2", {"tensor_parallel_size": 2,
                                               "enable_expert_parallel": True})):
        run = capture(kwargs, tmp_path / f"{name}.npz")
        assert run.returncode == 0, run.stderr[-3000:]
        results[name] = np.load(tmp_path / f"{name}.npz")
    one, two = results["one"]["signatures"], results["ep2"]["signatures"]
    np.testing.assert_array_equal(two.sum(2), one.sum(2))  # each token once, logical ids
    assert np.abs(one.astype(int) - two).sum() / 2 / one.sum() < 0.01


@two_gpus
@pytest.mark.parametrize(("kwargs", "named"), [
    ({"data_parallel_size": 2, "enable_expert_parallel": True}, "with data parallel"),
    ({"enable_dbo": True}, "with micro-batching"),
])
def test_layouts_eldr_cannot_record_are_refused_at_start(
    tmp_path: Path, kwargs: dict[str, object], named: str
) -> None:
    run = capture(kwargs, tmp_path / "out.npz")
    assert run.returncode != 0
    assert f"eldr cannot record expert signatures {named}" in run.stderr + run.stdout
