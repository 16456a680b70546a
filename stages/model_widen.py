"""Derive ``tiny-wide``: the bundled model with every expert widened by zero hidden units.

A Mixtral expert computes ``w2 @ (silu(w1 x) * (w3 x))``; extra rows of zeros in ``w1``/``w3``
and matching zero columns in ``w2`` add ``silu(0) * 0 = 0``, so outputs and routing are exactly
those of ``tiny``. What changes is the bytes a decode step reads per distinct expert: large
enough (hundreds of MB in all, well above the CPU's L3) that step time follows the number of
distinct experts, as it does for real MoE models on GPUs. Built deterministically in seconds at
first use instead of being committed.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from stages.paths import BUNDLED_MODELS_DIR, derived_models_dir

WIDE_INTERMEDIATE = 8192
_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(w1|w2|w3)\.weight$")
_COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
           "special_tokens_map.json", "chat_template.jinja")


def ensure_wide_model(
    source: Path = BUNDLED_MODELS_DIR / "tiny", intermediate: int = WIDE_INTERMEDIATE
) -> Path:
    target = derived_models_dir() / "tiny-wide"
    stamp = target / "eldr-derived.json"
    source_index = (source / "model.safetensors.index.json").read_bytes()
    # The recipe names the exact source weights, so a retrained tiny is never served stale.
    digest = hashlib.sha256(source_index)
    for shard in sorted(set(json.loads(source_index)["weight_map"].values())):
        digest.update((source / shard).read_bytes())
    recipe = {"source": str(source), "intermediate": intermediate,
              "source_sha256": digest.hexdigest()}
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return target
    staging = target.with_name("tiny-wide.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    old = int(config["intermediate_size"])
    config["intermediate_size"] = intermediate
    config.setdefault("eldr_routing_id", "tiny")
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    for name in _COPIED:
        if (source / name).exists():
            shutil.copy2(source / name, staging / name)
    index = json.loads(source_index)
    weight_map: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(source / shard)
        widened = {key: _widen(key, value, old, intermediate) for key, value in tensors.items()}
        save_file(widened, staging / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(widened, shard))
    (staging / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )
    (staging / "eldr-derived.json").write_text(json.dumps(recipe))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def _widen(key: str, weight: torch.Tensor, old: int, new: int) -> torch.Tensor:
    match = _EXPERT_WEIGHT.search(key)
    if match is None:
        return weight
    kind = match.group(1)
    if kind in ("w1", "w3"):  # [intermediate, hidden]
        assert weight.shape[0] == old, key
        return torch.cat([weight, weight.new_zeros(new - old, weight.shape[1])], dim=0)
    assert weight.shape[1] == old, key  # w2: [hidden, intermediate]
    return torch.cat([weight, weight.new_zeros(weight.shape[0], new - old)], dim=1)
