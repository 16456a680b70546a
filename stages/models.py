"""Model names users type: bundled presets, well-known hub models, or any path / hub id.

Resolution never downloads and never hangs: a hub model is used when its weights are already in
the local Hugging Face cache, or when the hub may be reached (``HF_HUB_OFFLINE`` unset), in which
case vLLM downloads it as usual. Otherwise the user gets a message naming what to run instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.errors import EldrError
from stages.paths import BUNDLED_MODELS_DIR
from stages.signature.dataset import ModelIdentity


@dataclass(frozen=True)
class ModelPreset:
    name: str
    description: str
    hub_id: str | None = None  # None: bundled with eldr
    derived: bool = False  # built at first use from the bundled weights


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("tiny", "bundled 28M-parameter Mixtral-style MoE (16 experts, top-2)"),
        ModelPreset(
            "tiny-wide",
            "tiny with experts widened by zero units: same outputs and routing, memory-bound",
            derived=True,
        ),
        ModelPreset("mixtral", "Mixtral 8x7B Instruct", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
        ModelPreset("qwen3-moe", "Qwen3 30B-A3B", "Qwen/Qwen3-30B-A3B"),
        ModelPreset("gpt-oss", "gpt-oss 120B", "openai/gpt-oss-120b"),
        ModelPreset("olmoe", "OLMoE 1B-7B Instruct", "allenai/OLMoE-1B-7B-0924-Instruct"),
        ModelPreset("qwen2-moe", "Qwen2 57B-A14B Instruct", "Qwen/Qwen2-57B-A14B-Instruct"),
        ModelPreset("deepseek", "DeepSeek-V2-Lite Chat", "deepseek-ai/DeepSeek-V2-Lite-Chat"),
    )
}
BUNDLED_HINT = "run the bundled model instead: `--model tiny` (or `--model tiny-wide`)"


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user typed (preset name, path or hub id)
    source: str  # what vLLM gets as --model: a local directory or a hub id
    identity: ModelIdentity
    config_path: Path


def resolve_model(name: str) -> ResolvedModel:
    preset = PRESETS.get(name)
    if preset is not None and preset.hub_id is None:
        if preset.derived:
            from stages.model_widen import ensure_wide_model

            path = ensure_wide_model()
        else:
            path = BUNDLED_MODELS_DIR / name
        if not (path / "config.json").exists():
            raise EldrError(f"bundled model '{name}' is missing at {path}; reinstall eldr")
        config = path / "config.json"
        return ResolvedModel(name, str(path), identity_from_config(config, name), config)
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise EldrError(f"{local} has no config.json: not a Hugging Face model directory")
        config = local / "config.json"
        return ResolvedModel(name, str(local), identity_from_config(config, name), config)
    hub_id = preset.hub_id if preset is not None else name
    if "/" not in hub_id:
        known = ", ".join(PRESETS)
        raise EldrError(f"unknown model '{name}': use a preset ({known}), a directory or a hub id")
    return _resolve_hub(name, hub_id)


def _resolve_hub(name: str, hub_id: str) -> ResolvedModel:
    config = _cached_hub_file(hub_id, "config.json")
    if config is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        reason = (
            "HF_HUB_OFFLINE is set"
            if offline
            else "the Hugging Face hub cannot be reached from this machine"
        )
        if offline or not _hub_reachable():
            raise EldrError(
                f"the weights of '{name}' ({hub_id}) are not in the local Hugging Face cache and"
                f" {reason}. Download them on a connected machine (`huggingface-cli download"
                f" {hub_id}`) and pass the directory with --model, or {BUNDLED_HINT}."
            )
        config = _download_config(hub_id)
    return ResolvedModel(name, hub_id, identity_from_config(config, name), config)


def _cached_hub_file(hub_id: str, filename: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(hub_id, filename)
    return Path(found) if isinstance(found, str) else None


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        httpx.head(endpoint, timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return True


def _download_config(hub_id: str) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(hub_id, "config.json"))


def identity_from_config(config_path: Path, name: str) -> ModelIdentity:
    """L, E, top-k and the MoE layer indices from a Hugging Face config, whatever the family
    calls them. The indices follow vLLM's model code; the engine reports the layers it actually
    built, and capture and serve check the two agree (``check_built_layers``)."""
    config = _text_config(config_path)
    experts = _first(config, "num_local_experts", "num_experts", "n_routed_experts")
    top_k = _first(config, "num_experts_per_tok", "experts_per_token", "moe_top_k", "top_k_experts")
    layers = _first(config, "num_hidden_layers", "n_layers")
    if not experts or not top_k or layers is None:
        raise EldrError(f"{config_path} does not describe a mixture-of-experts model")
    moe_layers = moe_layer_indices(config, int(layers))
    if not moe_layers:
        raise EldrError(f"{config_path}: no layer of this model is a mixture-of-experts layer")
    # Variants that keep routing identical (tiny and tiny-wide) share one identity, so their
    # signatures and artifacts are interchangeable.
    routing_id = str(config.get("eldr_routing_id", name))
    return ModelIdentity(routing_id, len(moe_layers), int(experts), int(top_k), moe_layers)


def moe_layer_indices(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Which transformer layers vLLM builds as MoE layers, by the keys families use for it."""

    def is_moe(i: int) -> bool:
        # DeepSeek V2/V3 (and GLM-4-MoE, Kimi, ...): dense first layers, then every freq-th.
        if i < int(config.get("first_k_dense_replace") or 0):
            return False
        freq = config.get("moe_layer_freq")
        if isinstance(freq, int) and freq > 1 and i % freq:
            return False
        # Qwen2-MoE / Qwen3-MoE: listed dense layers, then every step-th layer.
        if i in (config.get("mlp_only_layers") or ()):
            return False
        step = config.get("decoder_sparse_step")
        if isinstance(step, int) and step > 1 and (i + 1) % step:
            return False
        # Llama 4: MoE every step-th layer, counting from the step-th.
        step = config.get("interleave_moe_layer_step")
        return not (isinstance(step, int) and step > 1 and (i + 1) % step)

    return tuple(i for i in range(num_layers) if is_moe(i))


def check_built_layers(identity: ModelIdentity, built: tuple[int, ...], where: str) -> None:
    """Refuse a model whose engine built other MoE layers than its config says."""
    if tuple(built) != identity.moe_layers:
        raise EldrError(
            f"{where} built MoE layers {list(built)}, but the config of {identity.name} says"
            f" {list(identity.moe_layers)}: this model family marks its dense layers in a way"
            " eldr does not read yet; please report it"
        )


# What the KV cache a prefill worker hands over is shaped by.
_KV_SHAPE_KEYS = (
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_size", "vocab_size", "torch_dtype", "sliding_window", "rope_theta",
)


def check_handoff_compatible(prefill: ResolvedModel, decode: ResolvedModel) -> None:
    """Prefill on a different model than decode only when the two compute the same KV cache.

    The one sanctioned case is a routing-identical variant (``eldr_routing_id`` shared, as
    tiny and tiny-wide do: the wide model's extra expert units are zero, so every hidden state,
    and so every KV entry, is the narrow model's). vLLM's own NIXL handshake hash includes the
    model path and would refuse the pair, so eldr checks the pair here instead.
    """
    if prefill.identity != decode.identity:
        raise EldrError(
            f"--prefill-model {prefill.name} does not route like --model {decode.name}"
            f" ({prefill.identity} vs {decode.identity}): prefill may only run a variant that"
            " shares the decode model's eldr_routing_id (e.g. --model tiny-wide"
            " --prefill-model tiny), otherwise the hand-off would feed decode a foreign KV cache"
        )
    ours, theirs = _text_config(prefill.config_path), _text_config(decode.config_path)
    differing = [key for key in _KV_SHAPE_KEYS if ours.get(key) != theirs.get(key)]
    if differing:
        raise EldrError(
            f"--prefill-model {prefill.name} and --model {decode.name} differ in"
            f" {', '.join(differing)}: their KV caches are not interchangeable"
        )


def _text_config(config_path: Path) -> dict[str, Any]:
    """A Hugging Face config's language-model part (multimodal configs nest it)."""
    config = json.loads(Path(config_path).read_text())
    return config.get("text_config", config)


def _first(config: dict[str, object], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int):
            return value
    return None


def hub_cache_status(hub_id: str) -> str:
    """A look at the local cache only: listing presets must not touch the network."""
    if _cached_hub_file(hub_id, "config.json") is not None:
        return "in the local Hugging Face cache"
    return "not cached; vLLM downloads it where the hub is reachable"
