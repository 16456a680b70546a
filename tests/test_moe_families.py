"""The tiny per-family MoE builders and their HF routing reference (no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.moe_families import (
    FAMILIES,
    Family,
    HfRouting,
    build_model,
    hf_dispatched_experts,
    hf_routing,
    near_ties,
)

# BOS, then tokens spread over the vocabulary (fixed, so failures reproduce).
TOKENS = [0, *np.random.default_rng(7).integers(4, 4096, 23).tolist()]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-families")
    return {f.name: build_model(f, root / f.name) for f in FAMILIES}


@pytest.fixture(scope="module")
def routed(built: dict[str, Path]) -> dict[str, HfRouting]:
    # One HF forward per family, shared: loading and running is most of this module's time.
    return {name: hf_routing(path, TOKENS) for name, path in built.items()}


def test_family_names_are_unique() -> None:
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_dispatched_experts_shape_and_range(family: Family, routed: dict[str, HfRouting]) -> None:
    experts = routed[family.name].experts
    assert experts.shape == (len(family.moe_layers), len(TOKENS), family.top_k)
    assert np.issubdtype(experts.dtype, np.integer)
    assert experts.min() >= 0 and experts.max() < family.num_experts
    # A token never goes to the same expert twice; ids come back ascending.
    assert (np.diff(experts, axis=-1) > 0).all()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_moe_layers_match_the_model(family: Family, routed: dict[str, HfRouting]) -> None:
    routing = routed[family.name]
    assert routing.moe_layers == family.moe_layers
    assert routing.experts.shape[0] == len(family.moe_layers)
    assert all(0 <= i < family.num_layers for i in family.moe_layers)
    assert routing.near_tie.shape == routing.experts.shape[:2]
    assert routing.near_tie.dtype == bool
    # Sharpened routers: most tokens are clear-cut, so the reference is worth comparing to.
    assert routing.near_tie.mean() < 0.5


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_routing_depends_on_the_token(family: Family, routed: dict[str, HfRouting]) -> None:
    for layer in routed[family.name].experts:
        assert len({tuple(row) for row in layer}) > 1


def test_wrappers_agree_with_hf_routing(
    built: dict[str, Path], routed: dict[str, HfRouting]
) -> None:
    np.testing.assert_array_equal(hf_dispatched_experts(built["qwen2-moe"], TOKENS),
                                  routed["qwen2-moe"].experts)


def test_near_ties_grow_with_the_margin(built: dict[str, Path]) -> None:
    model = built["mixtral"]
    assert not near_ties(model, TOKENS, margin=0.0).any()
    assert near_ties(model, TOKENS, margin=100.0).all()


def test_checkpoints_carry_the_family_quirks(built: dict[str, Path]) -> None:
    def config(name: str) -> dict:
        return json.loads((built[name] / "config.json").read_text())

    assert config("deepseek-v2")["first_k_dense_replace"] == 1
    v3 = config("deepseek-v3")
    assert (v3["topk_method"], v3["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert v3["kv_lora_rank"] + v3["qk_rope_head_dim"] == 576
    assert config("qwen2-moe")["shared_expert_intermediate_size"] > 0
    assert config("qwen3-moe")["mlp_only_layers"] == [1]
    assert set(config("gpt-oss")["layer_types"]) == {"sliding_attention", "full_attention"}
    gemma = config("gemma4")
    assert gemma["enable_moe_block"] and gemma["top_k_experts"] == 2
    for path in built.values():
        assert (path / "tokenizer.json").exists()
        assert config(path.name)["vocab_size"] == 4096
