"""Graph-safe recording of each MoE layer's top-k expert ids.

vLLM's routers call ``capture_fn(topk_ids)`` right after choosing experts. What runs there must
survive torch.compile (on CPU, Dynamo traces straight through the MoE layer) and CUDA-graph
replay (no Python runs at all). So the hook does exactly one thing: it copies the ids into a
static buffer owned by the layer. When traced, the copy is a registered custom op,
``eldr::record_topk``, with that buffer declared as mutated so the compiler keeps the op in the
graph; in eager code (and so in a CUDA graph captured from it) it is the plain copy.
Everything else (which tokens are real, which KV block they land in) happens outside the graph,
once per step, in :class:`stages.capture.recorder.SignatureRecorder`.

The hook must be in place before vLLM's first forward, because that forward is what torch.compile
traces (on CPU, during the memory probe, before any KV cache or connector method exists). It is
therefore attached while the model is being built, by a torch module-registration hook that the
eldr plugin installs in every vLLM process; it acts only on MoE layers of an engine configured
with eldr's connector.
"""

from __future__ import annotations

from typing import Any

import torch

BUFFER_NAME = "eldr_topk_ids"
# Part of vLLM's compile-cache key (``additional_config`` is hashed into it): a graph traced
# without the hook must never be loaded for an engine that records, nor the reverse.
CACHE_KEY = "eldr_topk_capture"
CACHE_KEY_VERSION = 1
UNWRITTEN = -1  # rows the forward did not write keep this value (see SignatureRecorder)


def _copy_rows(buffer: torch.Tensor, topk_ids: torch.Tensor) -> None:
    rows = min(topk_ids.shape[0], buffer.shape[0])
    buffer[:rows].copy_(topk_ids[:rows])


def _record_topk_fake(buffer: torch.Tensor, topk_ids: torch.Tensor) -> None:
    return None


# Registered on a raw ``Library`` as vLLM registers its own ops, not through
# ``torch.library.custom_op``, whose Python dispatch layer costs several times the copy itself
# on every call of the compiled graph (once per MoE layer per step). The op lives as long as
# this handle, so it is held for the life of the process.
_ELDR_OPS = torch.library.Library("eldr", "DEF")
_ELDR_OPS.define("record_topk(Tensor(a!) buffer, Tensor topk_ids) -> ()")
# One kernel for every device: the copy is plain aten work, traceable and graph-capturable.
_ELDR_OPS.impl("record_topk", _copy_rows, "CompositeExplicitAutograd")
torch.library.register_fake("eldr::record_topk", _record_topk_fake, lib=_ELDR_OPS)


class TopkSink:
    """The router's ``capture_fn``: one copy of the ids into its layer's buffer.

    The buffer is looked up on the layer at call time (not captured once) so a module moved or
    rebuilt by vLLM after construction still writes into the buffer the recorder reads.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer

    def __call__(self, topk_ids: torch.Tensor) -> None:
        buffer = getattr(self.layer, BUFFER_NAME)
        if torch.compiler.is_compiling():
            # Traced: the registered op, which the compiler keeps with its mutation declared.
            torch.ops.eldr.record_topk(buffer, topk_ids)
        else:
            # Eager, or CUDA-graph capture of eager code: the copy itself, without the op's
            # dispatch (a few us per layer on CPU, more than the copy).
            _copy_rows(buffer, topk_ids)


def records_signatures(vllm_config: Any) -> bool:
    """True when the engine's kv-transfer config names eldr's connector (alone or composed)."""
    from stages.engine import SIGNATURE_CONNECTOR as CONNECTOR_NAME

    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None:
        return False
    if kv.kv_connector == CONNECTOR_NAME:
        return True
    connectors = (kv.kv_connector_extra_config or {}).get("connectors") or []
    return any(isinstance(c, dict) and c.get("kv_connector") == CONNECTOR_NAME for c in connectors)


def attach(layer: torch.nn.Module, max_tokens: int) -> bool:
    """Give one MoE layer its buffer and point its router at it; False if it has no router."""
    router = getattr(layer, "router", None)
    if router is None or not hasattr(router, "set_capture_fn"):
        return False
    if hasattr(layer, BUFFER_NAME):
        return True
    top_k = int(getattr(router, "top_k", 0) or layer.moe_config.experts_per_token)
    # Created under vLLM's model-construction device context, so it lives where the model does.
    buffer = torch.full((max_tokens, top_k), UNWRITTEN, dtype=torch.int32)
    layer.register_buffer(BUFFER_NAME, buffer, persistent=False)
    router.set_capture_fn(TopkSink(layer))
    return True


def install_construction_hook() -> Any:
    """Attach a buffer to every MoE layer built from now on in this process (plugin start-up)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import (
        MoERunnerInterface,
    )

    def on_registered(parent: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
        if not isinstance(module, MoERunnerInterface):
            return
        config = get_current_vllm_config_or_none()
        if config is None or not records_signatures(config):
            return
        if attach(module, int(config.scheduler_config.max_num_batched_tokens)):
            if isinstance(config.additional_config, dict):
                config.additional_config[CACHE_KEY] = CACHE_KEY_VERSION

    return torch.nn.modules.module.register_module_module_registration_hook(on_registered)
