"""Model identity: L, E, top-k and MoE layer indices from configs of every family."""

from __future__ import annotations

import json
import re
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
    ("config", "moe_layers", "experts", "top_k"),
    [
        # Mixtral / OLMoE / GPT-OSS: every layer.
        ({"num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2},
         (0, 1, 2, 3), 8, 2),
        # DeepSeek-V2/V3: dense first layer.
        ({"num_hidden_layers": 4, "n_routed_experts": 16, "num_experts_per_tok": 4,
          "first_k_dense_replace": 1, "moe_layer_freq": 1}, (1, 2, 3), 16, 4),
        ({"num_hidden_layers": 6, "n_routed_experts": 16, "num_experts_per_tok": 4,
          "first_k_dense_replace": 1, "moe_layer_freq": 2}, (2, 4), 16, 4),
        # Qwen2-MoE / Qwen3-MoE: listed dense layers, sparse step.
        ({"num_hidden_layers": 4, "num_experts": 64, "num_experts_per_tok": 8,
          "mlp_only_layers": [0], "decoder_sparse_step": 1}, (1, 2, 3), 64, 8),
        ({"num_hidden_layers": 4, "num_experts": 64, "num_experts_per_tok": 8,
          "mlp_only_layers": [], "decoder_sparse_step": 2}, (1, 3), 64, 8),
        # Llama 4: interleaved MoE layers.
        ({"num_hidden_layers": 4, "num_local_experts": 16, "num_experts_per_tok": 1,
          "interleave_moe_layer_step": 2}, (1, 3), 16, 1),
        # Gemma 4: a multimodal config nesting the text model, top-k named top_k_experts.
        ({"text_config": {"num_hidden_layers": 3, "num_experts": 128, "top_k_experts": 8,
                          "enable_moe_block": True}}, (0, 1, 2), 128, 8),
        # DBRX: n_layers, experts and top-k in a nested ffn_config, every layer MoE.
        ({"model_type": "dbrx", "n_layers": 3, "d_model": 64,
          "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 128}},
         (0, 1, 2), 16, 4),
        # Ernie-4.5-MoE: MoE from start to end index, every interval-th layer (1-based).
        ({"model_type": "ernie4_5_moe", "num_hidden_layers": 6, "moe_num_experts": 64,
          "moe_k": 6, "moe_layer_start_index": 1, "moe_layer_end_index": 4,
          "moe_layer_interval": 2}, (1, 3), 64, 6),
        # ... its config class's defaults: start 1, end -1 (the last layer), interval 1.
        ({"model_type": "ernie4_5_moe", "num_hidden_layers": 4, "moe_num_experts": 8,
          "moe_k": 2}, (1, 2, 3), 8, 2),
        ({"num_hidden_layers": 4, "moe_num_experts": 8, "moe_k": 2, "moe_layer_start_index": 0,
          "moe_layer_end_index": -1}, (0, 1, 2, 3), 8, 2),
        # Hunyuan V1: every layer MoE, top-k as one int or one per layer.
        ({"model_type": "hunyuan_v1_moe", "num_hidden_layers": 3, "num_experts": 64,
          "moe_topk": [8, 8, 8]}, (0, 1, 2), 64, 8),
        ({"model_type": "hunyuan_v1_moe", "num_hidden_layers": 2, "num_experts": [16, 16],
          "moe_topk": 2}, (0, 1), 16, 2),
        # Jamba: MoE where layer % period == offset (config class: period 2, offset 1).
        ({"model_type": "jamba", "num_hidden_layers": 8, "num_experts": 16,
          "num_experts_per_tok": 2, "expert_layer_period": 4, "expert_layer_offset": 2},
         (2, 6), 16, 2),
        ({"model_type": "jamba", "num_hidden_layers": 4, "num_experts": 16,
          "num_experts_per_tok": 2}, (1, 3), 16, 2),
        ({"num_hidden_layers": 4, "num_experts": 16, "num_experts_per_tok": 2,
          "expert_layer_period": 1, "expert_layer_offset": 0}, (0, 1, 2, 3), 16, 2),
        # Arctic: every frequency-th layer, counting from the frequency-th.
        ({"model_type": "arctic", "num_hidden_layers": 6, "num_local_experts": 128,
          "num_experts_per_tok": 2, "moe_layer_frequency": 3}, (2, 5), 128, 2),
        ({"num_hidden_layers": 3, "num_local_experts": 128, "num_experts_per_tok": 2,
          "moe_layer_frequency": 1}, (0, 1, 2), 128, 2),
        # Nemotron-H: 'E' in the pattern (M mamba, * attention, - MLP) ...
        ({"model_type": "nemotron_h", "num_hidden_layers": 8, "n_routed_experts": 128,
          "num_experts_per_tok": 6, "hybrid_override_pattern": "MEM*EM-E"},
         (1, 4, 7), 128, 6),
        # ... or "moe" in layers_block_type, which wins over the pattern and sets the count.
        ({"model_type": "nemotron_h", "n_routed_experts": 8, "num_experts_per_tok": 2,
          "layers_block_type": ["mamba", "moe", "attention", "moe"],
          "hybrid_override_pattern": "EEEE"}, (1, 3), 8, 2),
        # Step3: a comma-separated string of MoE layers, else every layer but the first.
        ({"model_type": "step3_text", "num_hidden_layers": 6, "moe_num_experts": 48,
          "moe_top_k": 3, "moe_layers_enum": "2, 3,5,9"}, (2, 3, 5), 48, 3),
        ({"model_type": "step3_text", "num_hidden_layers": 3, "moe_num_experts": 48,
          "moe_top_k": 3}, (1, 2), 48, 3),
        # Language models nested in multimodal / omni configs.
        ({"language_config": {"num_hidden_layers": 3, "n_routed_experts": 64,
                              "num_experts_per_tok": 6, "first_k_dense_replace": 1}},
         (1, 2), 64, 6),
        ({"llm_config": {"num_hidden_layers": 2, "num_experts": 60, "num_experts_per_tok": 4}},
         (0, 1), 60, 4),
        ({"thinker_config": {"text_config": {"num_hidden_layers": 3, "num_experts": 128,
                                             "num_experts_per_tok": 8,
                                             "mlp_only_layers": [2]}},
          "talker_config": {"num_hidden_layers": 9, "num_experts": 4}}, (0, 1), 128, 8),
    ],
)
def test_moe_layers_follow_each_family(
    tmp_path: Path, config: dict[str, Any], moe_layers: tuple[int, ...], experts: int,
    top_k: int,
) -> None:
    found = identity(tmp_path, config)
    assert found.moe_layers == moe_layers
    assert found.num_layers == len(moe_layers)
    assert found.num_experts == experts
    assert found.top_k == top_k


@pytest.mark.parametrize(
    ("config", "named"),
    [
        # A top-k per layer that differs: one identity cannot hold it.
        ({"model_type": "hunyuan_v1_moe", "num_hidden_layers": 2, "num_experts": 64,
          "moe_topk": [8, 4]}, "moe_topk differs between layers ([8, 4])"),
        # Ernie-4.5-VL's per-modality lists.
        ({"model_type": "ernie4_5_moe", "num_hidden_layers": 4, "moe_num_experts": 8,
          "moe_k": 2, "moe_layer_start_index": [1, 1]}, "moe_layer_start_index is [1, 1]"),
        ({"num_hidden_layers": 4, "num_experts": 16, "num_experts_per_tok": 2,
          "expert_layer_period": 0}, "expert_layer_period is 0"),
        ({"model_type": "arctic", "num_hidden_layers": 4, "num_local_experts": 8,
          "num_experts_per_tok": 2, "moe_layer_frequency": "2"}, "moe_layer_frequency is '2'"),
        ({"model_type": "nemotron_h", "n_routed_experts": 8, "num_experts_per_tok": 2,
          "hybrid_override_pattern": "MEX"}, "hybrid_override_pattern is 'MEX'"),
        ({"model_type": "nemotron_h", "n_routed_experts": 8, "num_experts_per_tok": 2},
         "hybrid_override_pattern is None"),
        ({"model_type": "nemotron_h", "n_routed_experts": 8, "num_experts_per_tok": 2,
          "layers_block_type": ["moe", "sparse"]}, "layers_block_type is ['moe', 'sparse']"),
        ({"model_type": "step3_text", "num_hidden_layers": 4, "moe_num_experts": 8,
          "moe_top_k": 2, "moe_layers_enum": [1, 2]}, "moe_layers_enum is [1, 2]"),
        ({"model_type": "step3_text", "num_hidden_layers": 4, "moe_num_experts": 8,
          "moe_top_k": 2, "moe_layers_enum": "1-3"}, "moe_layers_enum is '1-3'"),
        # Nemotron-H puzzle models set experts per layer.
        ({"model_type": "nemotron_h", "hybrid_override_pattern": "ME",
          "block_configs": [{"block_type": "moe", "n_routed_experts": 8}]}, "block_configs"),
        ({"num_experts": 8, "num_experts_per_tok": 2}, "num_hidden_layers or n_layers"),
    ],
)
def test_keys_eldr_cannot_read_are_named(
    tmp_path: Path, config: dict[str, Any], named: str
) -> None:
    with pytest.raises(EldrError, match=re.escape(named)) as refused:
        identity(tmp_path, config)
    assert str(tmp_path / "config.json") in str(refused.value)


def test_rules_agree_with_the_config_classes_vllm_reads(tmp_path: Path) -> None:
    """Configs saved by transformers (every default written out), read by eldr, against the
    attributes vLLM's model code reads from the loaded config class."""
    transformers = pytest.importorskip("transformers")

    def saved(model_type: str, **kwargs: Any) -> tuple[Any, ModelIdentity]:
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
        config.save_pretrained(tmp_path / model_type)
        return config, identity_from_config(tmp_path / model_type / "config.json", "m")

    jamba, found = saved("jamba", num_hidden_layers=6, num_experts=4, expert_layer_period=3,
                         expert_layer_offset=2)
    assert found.moe_layers == tuple(i for i, n in enumerate(jamba.layers_num_experts) if n > 1)
    nemotron, found = saved("nemotron_h", hybrid_override_pattern="M*EM-E", n_routed_experts=4)
    assert found.moe_layers == tuple(
        i for i, kind in enumerate(nemotron.hybrid_override_pattern) if kind == "E")
    ernie, found = saved("ernie4_5_moe", num_hidden_layers=7, moe_num_experts=4, moe_k=2,
                         moe_layer_interval=2)
    assert found.moe_layers == tuple(
        i for i in range(ernie.num_hidden_layers)
        if (i + 1) % ernie.moe_layer_interval == 0
        and ernie.moe_layer_start_index <= i <= ernie.moe_layer_end_index) == (1, 3, 5)
    dbrx, found = saved("dbrx", n_layers=2, ffn_config={"moe_num_experts": 4, "moe_top_k": 2})
    assert (found.moe_layers, found.num_experts, found.top_k) == (
        tuple(range(dbrx.n_layers)), dbrx.ffn_config.moe_num_experts, dbrx.ffn_config.moe_top_k)
    hunyuan, found = saved("hunyuan_v1_moe", num_hidden_layers=2, num_experts=4,
                           moe_topk=[2, 2])
    assert (found.moe_layers, found.num_experts, found.top_k) == (
        tuple(range(hunyuan.num_hidden_layers)), hunyuan.num_experts, hunyuan.moe_topk[0])


def test_dense_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EldrError, match="does not describe a mixture-of-experts"):
        identity(tmp_path, {"num_hidden_layers": 4, "hidden_size": 64})
    with pytest.raises(EldrError, match="does not describe a mixture-of-experts"):
        identity(tmp_path, {"num_hidden_layers": 4, "num_experts": 0, "num_experts_per_tok": 2})
    with pytest.raises(EldrError, match="does not describe a mixture-of-experts"):
        identity(tmp_path, {"num_hidden_layers": 4, "num_experts": 1, "num_experts_per_tok": 1})


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
