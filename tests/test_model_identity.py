"""Model identity: L, E, top-k and MoE layer indices from configs of every family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stages.errors import EldrError
from stages.models import check_built_layers, identity_from_config
from stages.signature import wire
from stages.signature.dataset import ModelIdentity


def identity(tmp_path: Path, config: dict[str, Any]) -> ModelIdentity:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return identity_from_config(path, "m")


@pytest.mark.parametrize(
    ("config", "moe_layers", "top_k"),
    [
        # Mixtral / OLMoE / GPT-OSS: every layer.
        ({"num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2},
         (0, 1, 2, 3), 2),
        # DeepSeek-V2/V3: dense first layer.
        ({"num_hidden_layers": 4, "n_routed_experts": 16, "num_experts_per_tok": 4,
          "first_k_dense_replace": 1, "moe_layer_freq": 1}, (1, 2, 3), 4),
        ({"num_hidden_layers": 6, "n_routed_experts": 16, "num_experts_per_tok": 4,
          "first_k_dense_replace": 1, "moe_layer_freq": 2}, (2, 4), 4),
        # Qwen2-MoE / Qwen3-MoE: listed dense layers, sparse step.
        ({"num_hidden_layers": 4, "num_experts": 64, "num_experts_per_tok": 8,
          "mlp_only_layers": [0], "decoder_sparse_step": 1}, (1, 2, 3), 8),
        ({"num_hidden_layers": 4, "num_experts": 64, "num_experts_per_tok": 8,
          "mlp_only_layers": [], "decoder_sparse_step": 2}, (1, 3), 8),
        # Llama 4: interleaved MoE layers.
        ({"num_hidden_layers": 4, "num_local_experts": 16, "num_experts_per_tok": 1,
          "interleave_moe_layer_step": 2}, (1, 3), 1),
        # Gemma 4: a multimodal config nesting the text model, top-k named top_k_experts.
        ({"text_config": {"num_hidden_layers": 3, "num_experts": 128, "top_k_experts": 8,
                          "enable_moe_block": True}}, (0, 1, 2), 8),
    ],
)
def test_moe_layers_follow_each_family(
    tmp_path: Path, config: dict[str, Any], moe_layers: tuple[int, ...], top_k: int
) -> None:
    found = identity(tmp_path, config)
    assert found.moe_layers == moe_layers
    assert found.num_layers == len(moe_layers)
    assert found.top_k == top_k


def test_dense_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EldrError, match="does not describe a mixture-of-experts"):
        identity(tmp_path, {"num_hidden_layers": 4, "hidden_size": 64})
    with pytest.raises(EldrError, match="does not describe a mixture-of-experts"):
        identity(tmp_path, {"num_hidden_layers": 4, "num_experts": 0, "num_experts_per_tok": 2})


def test_identity_without_layer_indices_reads_as_all_layers() -> None:
    old = ModelIdentity.from_dict({"name": "tiny", "num_layers": 4, "num_experts": 16,
                                   "top_k": 2})
    assert old == ModelIdentity("tiny", 4, 16, 2, (0, 1, 2, 3))
    assert ModelIdentity.from_dict(json.loads(json.dumps(old.to_dict()))) == old
    assert "MoE layers" not in old.describe()
    deepseek = ModelIdentity("ds", 3, 64, 6, (1, 2, 3))
    assert "MoE layers 1-3" in deepseek.describe()
    with pytest.raises(ValueError, match="2 MoE layer indices for L=3"):
        ModelIdentity("bad", 3, 8, 2, (0, 1))


def test_engine_built_layers_must_match_the_config() -> None:
    ident = ModelIdentity("ds", 3, 64, 6, (1, 2, 3))
    check_built_layers(ident, (1, 2, 3), "vLLM")
    with pytest.raises(EldrError, match=r"built MoE layers \[0, 1, 2\]"):
        check_built_layers(ident, (0, 1, 2), "vLLM")


def test_moe_layers_travel_beside_the_signature() -> None:
    counts = np.arange(6, dtype=np.int32).reshape(2, 3)
    params = wire.encode(counts, (1, 3))
    np.testing.assert_array_equal(wire.decode(params, (2, 3)), counts)
    assert wire.decode_moe_layers(params) == (1, 3)
    assert wire.decode_moe_layers(wire.encode(counts)) is None
    assert wire.decode_moe_layers({wire.MOE_LAYERS_KEY: ["x"]}) is None
