"""tiny-wide's derivation preserves the model's function and routing exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _small_mixtral(path: Path) -> None:
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(path, max_shard_size="20KB")


def test_widened_experts_give_identical_logits_and_routing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.model_widen import ensure_wide_model

    source = tmp_path / "src"
    _small_mixtral(source)
    monkeypatch.setenv("ELDR_HOME", str(tmp_path / "home"))
    wide = ensure_wide_model(source, intermediate=48)
    assert ensure_wide_model(source, intermediate=48) == wide  # second call reuses it

    ids = torch.tensor([[1, 5, 9, 13, 2, 40, 33]])
    outputs = []
    for path in (source, wide):
        model = transformers.MixtralForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        with torch.no_grad():
            outputs.append(model(ids, output_router_logits=True))
    assert transformers.AutoConfig.from_pretrained(wide).intermediate_size == 48
    torch.testing.assert_close(outputs[0].logits, outputs[1].logits, rtol=0, atol=1e-6)
    for a, b in zip(outputs[0].router_logits, outputs[1].router_logits, strict=True):
        assert torch.equal(a.topk(2).indices, b.topk(2).indices)
