"""Which KV cache group the signature table follows.

With vLLM's hybrid KV cache manager (HMA) a model with sliding-window or other local attention
layers gets one KV cache group per attention kind, each with its own block table. Blocks of a
sliding-window group are freed (and reused by other requests) once they fall out of the window,
so a prompt's signature must be summed over the blocks of a full-attention group: those keep
every token of the prompt for as long as the request lives, and are what prefix caching reuses.
Without HMA there is one group and it is that one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SignatureGroup:
    index: int  # position in kv_cache_config.kv_cache_groups (and in every block-id tuple)
    block_size: int
    layer_name: str  # an attention layer of the group: its slot mapping is the group's


def signature_group(kv_cache_config: Any) -> SignatureGroup:
    """The first full-attention group (MLA included) of the engine's KV cache config."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    for index, group in enumerate(groups):
        if isinstance(group.kv_cache_spec, FullAttentionSpec) and group.layer_names:
            if getattr(group, "is_eagle_group", False):
                continue
            return SignatureGroup(index, int(group.kv_cache_spec.block_size), group.layer_names[0])
    kinds = sorted({type(group.kv_cache_spec).__name__ for group in groups})
    raise RuntimeError(
        "eldr: this model has no full-attention KV cache group (only "
        + ", ".join(kinds) + "), so a prompt's KV blocks do not outlive its window and no"
        " expert signature can be kept exact under prefix caching"
    )
