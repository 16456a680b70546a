"""Every MoE family vLLM's CPU build runs, captured by eldr in vLLM's default (compiled) mode,
agrees with the experts the Hugging Face model dispatches each token to; so do two families in
eager mode (the recording hook is the same module there, run without the compiled graph, so
the bundled family and the one with the most routing parts stand for the rest and keep the
suite ~4 min shorter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stages.signature.dataset import SignatureDataset
from tests.arch_capture import MAX_TOKENS, family_prompts
from tests.conftest import requires_vllm
from tests.moe_families import FAMILIES, Family, hf_routing

pytestmark = [requires_vllm, pytest.mark.vllm]


# Mixtral: the bundled models' family; DeepSeek-V3: shared experts, grouped top-k, a bias.
EAGER_FAMILIES = tuple(f for f in FAMILIES if f.name in ("mixtral", "deepseek-v3"))


def capture_families(root: Path, mode: str, families: tuple[Family, ...]) -> Path:
    cmd = [sys.executable, "-m", "tests.arch_capture", mode, str(root),
           *(f.name for f in families)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1500,
                            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return capture_families(tmp_path_factory.mktemp("families-compiled"), "compiled", FAMILIES)


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return capture_families(tmp_path_factory.mktemp("families-eager"), "eager", EAGER_FAMILIES)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_compiled_capture_agrees_with_hugging_face_router(compiled: Path, family: Family) -> None:
    check_agreement(compiled, family)


@pytest.mark.parametrize("family", EAGER_FAMILIES, ids=lambda f: f.name)
def test_eager_capture_agrees_with_hugging_face_router(eager: Path, family: Family) -> None:
    check_agreement(eager, family)


def check_agreement(captured: Path, family: Family) -> None:
    from transformers import AutoTokenizer

    outcome = json.loads((captured / "results.json").read_text())[family.name]
    assert outcome["ok"], outcome.get("error")
    work = captured / family.name
    dataset = SignatureDataset.open(work / "sig.zarr")
    # The identity records the MoE layers as vLLM built them (dense layers left out).
    assert dataset.identity.moe_layers == family.moe_layers
    assert dataset.identity.shape == (len(family.moe_layers), family.num_experts)
    arrays = dataset.read()
    steps = sorted((work / "trace").glob("step-*.npy"))
    traced = np.concatenate([np.load(s) for s in steps], axis=1)  # [L, tokens, k]
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    texts = {p.id: p.prompt for p in family_prompts()}
    agree = clear_agree = clear_total = total = 0
    offset = 0
    for req_id, n_prompt, n_out, counts in zip(
        arrays.ids, arrays.prompt_tokens, arrays.output_tokens, arrays.prefill_counts,
        strict=True,
    ):
        ids = tokenizer(texts[str(req_id)])["input_ids"]
        assert len(ids) == n_prompt
        np.testing.assert_array_equal(counts.sum(axis=1), n_prompt * family.top_k)
        hf = hf_routing(work / "model", ids)
        ours = np.sort(traced[:, offset : offset + n_prompt], axis=-1)
        same = (ours == hf.experts).all(axis=-1)  # [L, tokens]
        agree += int(same.sum())
        clear_agree += int((same & ~hf.near_tie).sum())
        clear_total += int((~hf.near_tie).sum())
        total += same.size
        offset += n_prompt + n_out - 1
    assert offset == traced.shape[1]
    assert len(arrays) == len(family_prompts()) and (arrays.output_tokens == MAX_TOKENS).all()
    assert agree / total >= 0.98, f"agreement {agree / total:.4f} over {total} token-layers"
    # bf16 (vLLM) and fp32 (reference) may break near ties differently; nothing else may differ.
    assert clear_agree / clear_total >= 0.995, f"without near-ties {clear_agree / clear_total}"
