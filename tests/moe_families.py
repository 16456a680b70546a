"""Tiny random-weight MoE checkpoints, one per family vLLM's CPU build runs, plus the Hugging
Face reference of the experts each token is dispatched to.

The models are built at test time (nothing large is committed) from a fixed seed, with the
bundled tiny model's tokenizer, so a test can run vLLM on them and compare the experts vLLM
routes each token to with what transformers routes it to in float32.

Each family keeps the quirks a routing capture can get wrong: dense layers mixed in among the
MoE layers, shared experts, grouped top-k with a score-correction bias, routers whose input is
not the MLP's input (Gemma 4), and biased routers (GPT-OSS).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stages.paths import BUNDLED_MODELS_DIR

TOKENIZER_DIR = BUNDLED_MODELS_DIR / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
VOCAB = 4096
BOS, EOS, PAD = 0, 1, 3
SEED = 0
# Router logits get this standard deviation (over random tokens), so that the gap between the
# k-th and (k+1)-th expert is usually far larger than the bf16-vs-fp32 difference in the logits.
ROUTER_LOGIT_STD = 6.0
# A token counts as a near tie when moving every router logit by at most this much could change
# its expert set (see `hf_routing`). bf16 moved logits by ~0.02 on average, 0.1 at p99 here.
DEFAULT_TIE_MARGIN = 0.25


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int


# Heads are 32 or 64 wide: vLLM's CPU attention rejects smaller head sizes.
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
    "max_position_embeddings": 2048, "tie_word_embeddings": False, "initializer_range": 0.02,
    "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "rms_norm_eps": 1e-6,
}
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _mixtral() -> dict[str, Any]:
    return {**_COMMON, "model_type": "mixtral", "num_hidden_layers": 2, "intermediate_size": 128,
            "num_local_experts": 8, "num_experts_per_tok": 2, "rope_parameters": _ROPE}


def _qwen2_moe() -> dict[str, Any]:
    # Layer 0 dense via mlp_only_layers; every layer MoE otherwise (decoder_sparse_step=1).
    return {**_COMMON, "model_type": "qwen2_moe", "num_hidden_layers": 3,
            "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 8,
            "num_experts_per_tok": 2, "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [0], "decoder_sparse_step": 1, "norm_topk_prob": False,
            "use_sliding_window": False, "rope_parameters": _ROPE}


def _qwen3_moe() -> dict[str, Any]:
    # A dense layer in the middle, so layer index != MoE index after it.
    return {**_COMMON, "model_type": "qwen3_moe", "num_hidden_layers": 3,
            "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 8,
            "num_experts_per_tok": 2, "mlp_only_layers": [1], "decoder_sparse_step": 1,
            "norm_topk_prob": True, "use_sliding_window": False, "rope_parameters": _ROPE}


def _olmoe() -> dict[str, Any]:
    return {**_COMMON, "model_type": "olmoe", "num_hidden_layers": 2, "intermediate_size": 64,
            "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False,
            "rope_parameters": _ROPE}


def _deepseek(model_type: str) -> dict[str, Any]:
    # vLLM's CPU MLA needs kv_lora_rank + qk_rope_head_dim == 576 (the DeepSeek shape).
    return {**_COMMON, "model_type": model_type, "num_hidden_layers": 3,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 128, "moe_intermediate_size": 64, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "moe_layer_freq": 1, "n_group": 4, "topk_group": 2, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "hidden_act": "silu", "rope_parameters": _ROPE}


def _deepseek_v2() -> dict[str, Any]:
    # q_lora_rank None is the V2-Lite attention path (q_proj instead of q_a/q_b).
    return {**_deepseek("deepseek_v2"), "q_lora_rank": None,
            "topk_method": "group_limited_greedy", "norm_topk_prob": False,
            "routed_scaling_factor": 1.0}


def _deepseek_v3() -> dict[str, Any]:
    # HF's V3 config has no topk_method/scoring_func (its router is always sigmoid + bias);
    # vLLM reads them from the config and only creates e_score_correction_bias for noaux_tc.
    return {**_deepseek("deepseek_v3"), "q_lora_rank": 64, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
            "rope_interleave": True, "num_nextn_predict_layers": 0}


def _gpt_oss() -> dict[str, Any]:
    return {**_COMMON, "model_type": "gpt_oss", "num_hidden_layers": 2, "intermediate_size": 64,
            "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 64,
            "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"], "attention_bias": True}


def _ernie45_moe() -> dict[str, Any]:
    # Dense first and last layers (MoE from moe_layer_start_index to moe_layer_end_index) and a
    # shared expert. The router picks by softmax probability plus a correction bias, left at
    # zero here (as built), so it picks by logit like the others.
    return {**_COMMON, "model_type": "ernie4_5_moe", "num_hidden_layers": 4,
            "intermediate_size": 128, "moe_intermediate_size": 64, "moe_num_experts": 8,
            "moe_k": 2, "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
            "moe_layer_end_index": 2, "moe_layer_interval": 1, "rope_parameters": _ROPE}


def _gemma4() -> dict[str, Any]:
    # Every Gemma 4 MoE layer also keeps its dense MLP (run in parallel), so there is no dense
    # layer; the router reads the residual stream rather than the MLP's normed input.
    return {**_COMMON, "model_type": "gemma4_text", "num_hidden_layers": 2,
            "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 8,
            "top_k_experts": 2, "enable_moe_block": True, "head_dim": 32, "global_head_dim": 64,
            "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128,
            "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": VOCAB,
            "num_kv_shared_layers": 0, "attention_k_eq_v": False, "tie_word_embeddings": True,
            "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"}


FAMILIES: tuple[Family, ...] = (
    Family("mixtral", "MixtralForCausalLM", 2, (0, 1), 8, 2),
    Family("qwen2-moe", "Qwen2MoeForCausalLM", 3, (1, 2), 8, 2),
    Family("qwen3-moe", "Qwen3MoeForCausalLM", 3, (0, 2), 8, 2),
    Family("olmoe", "OlmoeForCausalLM", 2, (0, 1), 8, 2),
    Family("deepseek-v2", "DeepseekV2ForCausalLM", 3, (1, 2), 8, 2),
    Family("deepseek-v3", "DeepseekV3ForCausalLM", 3, (1, 2), 8, 2),
    Family("gpt-oss", "GptOssForCausalLM", 2, (0, 1), 8, 2),
    Family("gemma4", "Gemma4ForCausalLM", 2, (0, 1), 8, 2),
    Family("ernie45-moe", "Ernie4_5_MoeForCausalLM", 4, (1, 2), 8, 2),
)
FAMILY_BY_NAME = {f.name: f for f in FAMILIES}

_CONFIGS: dict[str, Callable[[], dict[str, Any]]] = {
    "mixtral": _mixtral, "qwen2-moe": _qwen2_moe, "qwen3-moe": _qwen3_moe, "olmoe": _olmoe,
    "deepseek-v2": _deepseek_v2, "deepseek-v3": _deepseek_v3, "gpt-oss": _gpt_oss,
    "gemma4": _gemma4, "ernie45-moe": _ernie45_moe,
}


def config_dict(family: Family) -> dict[str, Any]:
    return _CONFIGS[family.name]()


# ---------------------------------------------------------------------------------------------
# Building


def _make_config(family: Family) -> Any:
    from transformers import AutoConfig

    cfg = config_dict(family)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config.architectures = [family.architecture]
    return config


def _is_router(module: Any) -> bool:
    return type(module).__name__.lower().endswith("router")


def _is_experts(module: Any) -> bool:
    return type(module).__name__.endswith("Experts")


def _layer_of(name: str) -> int:
    match = re.search(r"\blayers\.(\d+)\.", name + ".")
    if match is None:
        raise ValueError(f"no layer index in module name {name!r}")
    return int(match.group(1))


def _router_weight(router: Any) -> Any:
    # Gemma 4's router wraps its projection (after a norm and a learned scale).
    return router.proj.weight if hasattr(router, "proj") else router.weight


def _sharpen_routers(model: Any, hidden_size: int, generator: Any) -> None:
    import torch

    # The router input is RMS-normalised to ~unit scale per element (Gemma 4 divides by
    # sqrt(hidden) but multiplies a learned scale back in, which we leave at 1 here), so a weight
    # std of s gives logits of std s*sqrt(hidden).
    with torch.no_grad():
        for _, module in model.named_modules():
            if not _is_router(module):
                continue
            weight = _router_weight(module)
            std = ROUTER_LOGIT_STD / hidden_size**0.5
            if hasattr(module, "proj"):
                std *= hidden_size**0.5  # undo Gemma 4's 1/sqrt(hidden) input scaling
            weight.copy_(torch.randn(weight.shape, generator=generator) * std)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.nn.Parameter):
                bias.copy_(torch.randn(bias.shape, generator=generator) * 0.5)
            correction = getattr(module, "e_score_correction_bias", None)
            if correction is not None:
                # Big enough to change some picks against the bare sigmoid, so a capture that
                # ignores the bias disagrees with the reference.
                correction.copy_(torch.randn(correction.shape, generator=generator) * 0.05)
            per_expert = getattr(module, "per_expert_scale", None)
            if per_expert is not None:
                # Weights only, not the choice; non-trivial so a checkpoint mix-up shows.
                per_expert.copy_(1.0 + 0.5 * torch.rand(per_expert.shape, generator=generator))


def _temper_gemma4_attention(model: Any) -> None:
    import torch

    # Gemma 4 attends with scale 1.0 to RMS-normed q and k, so at q_norm=1 its attention logits
    # are ~sqrt(head_dim) wide and nearly one-hot, and bf16 rounding in them moved router logits
    # by >1 (10x other families). Trained checkpoints learn small q_norm weights; imitate that.
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("self_attn.q_norm"):
                module.weight.mul_(module.weight.shape[0] ** -0.5)


def build_model(family: Family, out_dir: Path) -> Path:
    """Write config.json, bf16 safetensors and the bundled tokenizer into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _make_config(family)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(SEED + 1)
    _sharpen_routers(model, config.hidden_size, generator)
    if family.name == "gemma4":
        _temper_gemma4_attention(model)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = TOKENIZER_DIR / name
        if src.exists():
            shutil.copyfile(src, out_dir / name)
    (out_dir / "eldr_family.json").write_text(json.dumps({"family": family.name}) + "\n")
    return out_dir


# ---------------------------------------------------------------------------------------------
# Hugging Face reference


@dataclass(frozen=True)
class HfRouting:
    experts: np.ndarray  # int64 [num_moe_layers, num_tokens, top_k], ids ascending per token
    near_tie: np.ndarray  # bool [num_moe_layers, num_tokens]
    moe_layers: tuple[int, ...]


def _family_of(model_dir: Path) -> Family:
    return FAMILY_BY_NAME[json.loads((Path(model_dir) / "eldr_family.json").read_text())["family"]]


def _score_fn(family: Family, router: Any) -> Callable[[Any], Any]:
    """The score the router's top-k compares, as a function of the logits.

    Every router picks by a score that is an increasing function of its own expert's logit
    (softmax preserves the logit order, so the logits themselves do), which is what lets
    `_near_ties` bound the effect of a logit perturbation expert by expert.
    """
    import torch

    if family.name == "deepseek-v3":
        bias = router.e_score_correction_bias.detach().float()
        return lambda logits: torch.sigmoid(logits) + bias
    return lambda logits: logits


def _grouping(family: Family, config: Any) -> tuple[int, int, str]:
    """(n_group, topk_group, how a group is scored) for grouped top-k; (1, 1, ...) if none."""
    if family.name == "deepseek-v3":
        return config.n_group, config.topk_group, "top2sum"
    if family.name == "deepseek-v2":
        return config.n_group, config.topk_group, "max"
    return 1, 1, "max"


def _group_scores(scores: Any, n_group: int, reduce: str) -> Any:
    grouped = scores.view(scores.shape[0], n_group, -1)
    if reduce == "top2sum":
        return grouped.topk(2, dim=-1).values.sum(dim=-1)
    return grouped.max(dim=-1).values


def _select(scores: Any, top_k: int, n_group: int, topk_group: int, reduce: str) -> Any:
    """Bool mask [tokens, experts] of the chosen experts, and of the allowed (group) experts."""
    import torch

    if n_group > 1:
        groups = _group_scores(scores, n_group, reduce).topk(topk_group, dim=-1).indices
        group_mask = torch.zeros(scores.shape[0], n_group, dtype=torch.bool)
        group_mask.scatter_(1, groups, True)
        allowed = group_mask.repeat_interleave(scores.shape[1] // n_group, dim=1)
    else:
        group_mask = torch.ones(scores.shape[0], 1, dtype=torch.bool)
        allowed = torch.ones_like(scores, dtype=torch.bool)
    masked = scores.masked_fill(~allowed, float("-inf"))
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen.scatter_(1, masked.topk(top_k, dim=-1).indices, True)
    return chosen, allowed, group_mask


def _near_ties(logits: Any, score: Callable[[Any], Any], top_k: int, n_group: int,
               topk_group: int, reduce: str, margin: float) -> tuple[Any, Any]:
    """Recompute the router's choice from its logits, and flag tokens where moving each logit
    by at most `margin` could change it (interval bounds: scores are monotone per expert)."""
    import torch

    nominal = score(logits)
    lo, hi = score(logits - margin), score(logits + margin)
    chosen, allowed, group_mask = _select(nominal, top_k, n_group, topk_group, reduce)
    inf = torch.tensor(float("inf"))
    tie = lo.masked_fill(~chosen, inf).min(dim=-1).values <= hi.masked_fill(
        chosen | ~allowed, -inf).max(dim=-1).values
    if n_group > 1:
        glo, ghi = _group_scores(lo, n_group, reduce), _group_scores(hi, n_group, reduce)
        tie |= glo.masked_fill(~group_mask, inf).min(dim=-1).values <= ghi.masked_fill(
            group_mask, -inf).max(dim=-1).values
    return chosen, tie


def hf_routing(model_dir: Path, token_ids: list[int], margin: float = DEFAULT_TIE_MARGIN,
               dtype: str = "float32") -> HfRouting:
    """Run the HF model in float32 on one sequence and record, per MoE layer (in layer order),
    the expert ids its experts module receives for each token, and which tokens are near ties.

    The ids are read by a forward pre-hook on each `*Experts` module, i.e. after grouped top-k,
    score-correction bias and any masking, so they are what the model actually dispatches.
    """
    import torch
    from transformers import AutoModelForCausalLM

    family = _family_of(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    dispatched: dict[int, Any] = {}
    logits: dict[int, Any] = {}
    routers: dict[int, Any] = {}
    handles = []

    def on_experts(layer: int) -> Callable[..., None]:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # Every family calls experts(hidden, top_k_index, top_k_weights) positionally;
            # the keyword names differ (GPT-OSS: router_indices).
            index = args[1] if len(args) > 1 else next(
                v for k, v in kwargs.items() if k in ("top_k_index", "router_indices"))
            dispatched[layer] = index.detach().clone()

        return hook

    def on_logits(layer: int) -> Callable[..., None]:
        def hook(_module: Any, _args: tuple[Any, ...], out: Any) -> None:
            logits[layer] = (out[0] if isinstance(out, tuple) else out).detach().float().clone()

        return hook

    for name, module in model.named_modules():
        if _is_experts(module):
            handles.append(module.register_forward_pre_hook(
                on_experts(_layer_of(name)), with_kwargs=True))
        elif _is_router(module):
            layer = _layer_of(name)
            routers[layer] = module
            source = module.proj if hasattr(module, "proj") else module
            handles.append(source.register_forward_hook(on_logits(layer)))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([token_ids], dtype=torch.long), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    layers = tuple(sorted(dispatched))
    if layers != family.moe_layers:
        raise AssertionError(f"{family.name}: MoE layers {layers} != {family.moe_layers}")
    n = len(token_ids)
    experts = np.stack([dispatched[i].reshape(n, -1).numpy() for i in layers]).astype(np.int64)
    experts.sort(axis=-1)

    n_group, topk_group, reduce = _grouping(family, model.config)
    near = np.zeros((len(layers), n), dtype=bool)
    for row, layer in enumerate(layers):
        score = _score_fn(family, routers[layer])
        chosen, tie = _near_ties(logits[layer].reshape(n, -1), score, family.top_k,
                                 n_group, topk_group, reduce, margin)
        # The recomputed choice must match what the experts received, or the tie flags would
        # describe a different rule from the one the model runs.
        ours = np.sort(chosen.nonzero()[:, 1].reshape(n, -1).numpy(), axis=-1)
        if not np.array_equal(ours[~tie.numpy()], experts[row][~tie.numpy()]):
            raise AssertionError(f"{family.name} layer {layer}: recomputed top-k differs")
        near[row] = tie.numpy()
    return HfRouting(experts=experts, near_tie=near, moe_layers=layers)


def hf_dispatched_experts(model_dir: Path, token_ids: list[int]) -> np.ndarray:
    """int64 [num_moe_layers, num_tokens, top_k]: expert ids (ascending) per token, fp32 HF."""
    return hf_routing(model_dir, token_ids).experts


def near_ties(model_dir: Path, token_ids: list[int],
              margin: float = DEFAULT_TIE_MARGIN) -> np.ndarray:
    """bool [num_moe_layers, num_tokens]: tokens whose expert set a logit move of at most
    `margin` could change, so bf16 and fp32 may legitimately route them differently."""
    return hf_routing(model_dir, token_ids, margin).near_tie
