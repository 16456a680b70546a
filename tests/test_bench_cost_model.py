"""The step-time cost model: fitting recovers known parameters; presets hold their claims."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stages.errors import EldrError
from stages.routing.cost_model import (
    CostModel,
    CostSample,
    cpu_like,
    fit_cost_model,
    fit_prefill,
    fit_quality,
    gpu_like,
)

TRUE = CostModel(num_layers=24, base_s=4e-3, per_token_s=60e-6, per_expert_s=5e-6)


def _samples(noise: float, seed: int = 0) -> list[CostSample]:
    rng = np.random.default_rng(seed)
    out = []
    for batch in (1, 4, 16, 48):
        for distinct in (8.0, 20.0, 40.0, 64.0):
            step = float(TRUE.step_time(batch, distinct)) * (1 + noise * rng.standard_normal())
            out.append(CostSample(batch, distinct, step, steps=100))
    return out


def test_fit_recovers_exact_parameters() -> None:
    fit = fit_cost_model(_samples(0.0), num_layers=24)
    assert fit.base_s == pytest.approx(TRUE.base_s, rel=1e-6)
    assert fit.per_token_s == pytest.approx(TRUE.per_token_s, rel=1e-6)
    assert fit.per_expert_s == pytest.approx(TRUE.per_expert_s, rel=1e-6)
    assert fit_quality(fit, _samples(0.0))["r2"] == pytest.approx(1.0)


def test_fit_with_noise_stays_close() -> None:
    fit = fit_cost_model(_samples(0.01, seed=5), num_layers=24)
    assert fit.per_expert_s == pytest.approx(TRUE.per_expert_s, rel=0.1)
    assert fit.per_token_s == pytest.approx(TRUE.per_token_s, rel=0.2)
    assert fit_quality(fit, _samples(0.01, seed=5))["r2"] > 0.95


def test_fit_needs_variation_in_both_inputs() -> None:
    same_batch = [CostSample(8, d, 0.01 + d * 1e-4) for d in (5.0, 10.0, 20.0)]
    with pytest.raises(EldrError, match="vary both"):
        fit_cost_model(same_batch, num_layers=4)
    with pytest.raises(EldrError, match="at least 3"):
        fit_cost_model(same_batch[:2], num_layers=4)


def _moe_layer_time(m: CostModel, distinct: float) -> float:
    return m.moe_fixed_s + m.per_expert_s * distinct


def test_gpu_preset_reproduces_the_moe_layer_ratio() -> None:
    for experts in (64, 128):
        m = gpu_like(num_layers=48, num_experts=experts)
        assert _moe_layer_time(m, experts) / _moe_layer_time(m, experts / 8) == pytest.approx(4.7)
    m = gpu_like(48, 128)
    # More distinct experts, same batch: slower step; the gap is all MoE weight traffic.
    gap = float(m.step_time(32, 128) - m.step_time(32, 16))
    assert gap == pytest.approx(48 * (_moe_layer_time(m, 128) - _moe_layer_time(m, 16)))
    assert cpu_like(4).step_time(16, 16) > cpu_like(4).step_time(16, 2)


def test_save_load_roundtrip_and_rejects_unknown_fields(tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    TRUE.save(path)
    assert CostModel.load(path) == TRUE
    path.write_text(
        '{"num_layers": 2, "base_s": 0.1, "per_token_s": 0, "per_expert_s": 0, "typo": 1}'
    )
    with pytest.raises(EldrError, match="typo"):
        CostModel.load(path)
    with pytest.raises(EldrError):
        CostModel(num_layers=2, base_s=-1.0, per_token_s=0.0, per_expert_s=0.0)


def test_prefill_fit() -> None:
    tokens = [10, 50, 100, 400]
    base, per_token = fit_prefill(tokens, [0.01 + 2e-4 * t for t in tokens])
    assert base == pytest.approx(0.01) and per_token == pytest.approx(2e-4)
