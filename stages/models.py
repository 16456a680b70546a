"""Model names users type: bundled presets, well-known hub models, or any path / hub id.

Resolution never downloads and never hangs: a hub model is used when its weights are already in
the local Hugging Face cache, or when the hub may be reached (``HF_HUB_OFFLINE`` unset), in which
case vLLM downloads it as usual. Otherwise the user gets a message naming what to run instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
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
    try:
        # DBRX keeps its expert settings in a nested ffn_config.
        ffn = config.get("ffn_config")
        moe = {**config, **ffn} if isinstance(ffn, dict) else config
        experts = _first(moe, "num_local_experts", "num_experts", "n_routed_experts",
                         "moe_num_experts")
        top_k = _first(moe, "num_experts_per_tok", "experts_per_token", "moe_top_k",
                       "top_k_experts", "moe_k", "moe_topk")
        if experts is None and "block_configs" in config:
            raise EldrError("its experts are set per layer in block_configs, which eldr does"
                            " not read")
        # A single expert routes nothing (Jamba builds a plain MLP for it).
        if experts is None or experts < 2 or not top_k:
            raise EldrError("it does not describe a mixture-of-experts model")
        moe_layers = moe_layer_indices(config)
    except EldrError as e:
        raise EldrError(f"{config_path}: {e}") from None
    if not moe_layers:
        raise EldrError(f"{config_path}: no layer of this model is a mixture-of-experts layer")
    # Variants that keep routing identical (tiny and tiny-wide) share one identity, so their
    # signatures and artifacts are interchangeable.
    routing_id = str(config.get("eldr_routing_id", name))
    return ModelIdentity(routing_id, len(moe_layers), int(experts), int(top_k), moe_layers)


def moe_layer_indices(config: dict[str, Any]) -> tuple[int, ...]:
    """Which transformer layers vLLM builds as MoE layers: by the rule of the config's family
    where it has its own, else by the keys several families share."""
    for family in _FAMILIES:
        if config.get("model_type") in family.model_types or not family.keys.isdisjoint(config):
            return tuple(sorted(set(family.moe_layers(config))))
    return tuple(i for i in range(_layer_count(config)) if _is_moe_by_shared_keys(config, i))


def _is_moe_by_shared_keys(config: dict[str, Any], i: int) -> bool:
    # DeepSeek V2/V3 (and GLM-4-MoE, Kimi, Hunyuan V3, ...): dense first layers, then every
    # freq-th.
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


# Families that mark their MoE layers with keys of their own. Each rule is the condition in
# vLLM's model code for the family; a key the config leaves out takes the default of the
# family's config class, which is what vLLM reads.


def _every_layer(config: dict[str, Any]) -> range:
    # DBRX (DbrxBlock) and Hunyuan V1, which vLLM runs through its Transformers backend
    # (HunYuanMoEV1DecoderLayer): no dense layer, whatever other keys the config carries.
    return range(_layer_count(config))


def _jamba(config: dict[str, Any]) -> list[int]:
    # JambaConfig.layers_num_experts, which vLLM's jamba.py builds MoE where it is > 1.
    period = _int(config, "expert_layer_period", 2, least=1)
    offset = _int(config, "expert_layer_offset", 1)
    return [i for i in range(_layer_count(config)) if i % period == offset]


def _ernie45_moe(config: dict[str, Any]) -> list[int]:
    # Ernie4_5_MoeDecoderLayer in vLLM's ernie45_moe.py; Ernie4_5_MoeConfig reads an end
    # index of -1 as the last layer.
    if not config.get("use_moe", True):
        return []
    layers = _layer_count(config)
    start = _int(config, "moe_layer_start_index", 1)
    end = _int(config, "moe_layer_end_index", -1)
    end = layers - 1 if end == -1 else end
    interval = _int(config, "moe_layer_interval", 1, least=1)
    return [i for i in range(layers) if start <= i <= end and (i + 1) % interval == 0]


def _arctic(config: dict[str, Any]) -> list[int]:
    # ArcticMoE.is_moe_layer in vLLM up to 0.27 (vLLM 0.28 dropped Arctic).
    freq = _int(config, "moe_layer_frequency", 2, least=1)
    return [i for i in range(_layer_count(config)) if (i + 1) % freq == 0]


_NEMOTRON_H_KINDS: dict[str, tuple[type, str, tuple[str, ...]]] = {
    # NemotronHConfig takes layers_block_type over the older pattern string ('E' = "moe"),
    # and vLLM's nemotron_h.py builds NemotronHMoEDecoderLayer for exactly those layers.
    "layers_block_type": (list, "moe", ("moe", "mlp", "full_attention", "linear_attention",
                                        "attention", "mamba")),
    "hybrid_override_pattern": (str, "E", tuple("ME*-")),
}


def _nemotron_h(config: dict[str, Any]) -> list[int]:
    key = "layers_block_type" if config.get("layers_block_type") is not None else (
        "hybrid_override_pattern")
    kind_type, moe, known = _NEMOTRON_H_KINDS[key]
    kinds = config.get(key)
    if not isinstance(kinds, kind_type) or not kinds or any(k not in known for k in kinds):
        raise EldrError(f"{key} is {kinds!r}, which eldr cannot read: it expects one of"
                        f" {', '.join(known)} per layer")
    return [i for i, kind in enumerate(kinds) if kind == moe]


def _step3(config: dict[str, Any]) -> list[int]:
    # Step3TextDecoderLayer (and Step3p5's) in vLLM: a comma-separated string of layer
    # indices; without one, every layer but the first.
    layers = _layer_count(config)
    listed = config.get("moe_layers_enum")
    if listed is None:
        return list(range(1, layers))
    try:
        indices = [int(i) for i in listed.strip().split(",")]
    except (AttributeError, ValueError):
        raise EldrError(f"moe_layers_enum is {listed!r}, which eldr cannot read: it expects"
                        " layer indices separated by commas") from None
    return [i for i in indices if 0 <= i < layers]


@dataclass(frozen=True)
class _Family:
    model_types: frozenset[str]
    keys: frozenset[str]  # keys only this family uses: a config with one follows its rule
    moe_layers: Callable[[dict[str, Any]], Iterable[int]]


_FAMILIES = (
    _Family(frozenset({"jamba"}), frozenset({"expert_layer_period", "expert_layer_offset"}),
            _jamba),
    _Family(frozenset({"ernie4_5_moe"}),
            frozenset({"moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"}),
            _ernie45_moe),
    _Family(frozenset({"arctic"}), frozenset({"moe_layer_frequency"}), _arctic),
    _Family(frozenset({"nemotron_h"}), frozenset({"hybrid_override_pattern"}), _nemotron_h),
    _Family(frozenset({"step3_text", "step3p5"}), frozenset({"moe_layers_enum"}), _step3),
    _Family(frozenset({"dbrx", "hunyuan_v1_moe"}), frozenset(), _every_layer),
)


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


# Where multimodal and omni configs keep their language model; Qwen3-Omni nests it twice
# (thinker_config, then its text_config).
_NESTED_CONFIG_KEYS = ("thinker_config", "text_config", "language_config", "llm_config")


def _text_config(config_path: Path) -> dict[str, Any]:
    """A Hugging Face config's language-model part."""
    config = json.loads(Path(config_path).read_text())
    while True:
        inner = next((config[k] for k in _NESTED_CONFIG_KEYS if isinstance(config.get(k), dict)),
                     None)
        if inner is None:
            return config
        config = inner


def _first(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        # Hunyuan may give one value per layer; eldr's identity has one for all of them.
        if isinstance(value, list) and value:
            if any(v != value[0] for v in value):
                raise EldrError(f"{key} differs between layers ({value}): eldr needs one value"
                                " for every MoE layer")
            value = value[0]
        if isinstance(value, int):
            return value
    return None


def _layer_count(config: dict[str, Any]) -> int:
    layers = _first(config, "num_hidden_layers", "n_layers")
    if layers is None:
        raise EldrError("it names no layer count (num_hidden_layers or n_layers)")
    return layers


def _int(config: dict[str, Any], key: str, default: int, least: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, int) and (least is None or value >= least):
        return value
    wanted = "an integer" if least is None else f"an integer of at least {least}"
    raise EldrError(f"{key} is {value!r}, which eldr cannot read: it expects {wanted}")


def hub_cache_status(hub_id: str) -> str:
    """A look at the local cache only: listing presets must not touch the network."""
    if _cached_hub_file(hub_id, "config.json") is not None:
        return "in the local Hugging Face cache"
    return "not cached; vLLM downloads it where the hub is reachable"
