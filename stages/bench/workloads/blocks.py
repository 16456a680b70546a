"""KV blocks as a prefix cache sees them: a prompt's full blocks, each named by a hash chained
on its parent's, so equal hashes mean equal prefixes (vLLM's scheme; the exact hash function
does not matter for counting hits, only that it chains)."""

from __future__ import annotations

from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per FULL block of ``token_ids`` (a partial last block is never cached)."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


def cacheable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Most blocks of a prompt a prefix cache can serve: vLLM always computes the last prompt
    token (it needs its logits), so a hit covers at most ``prompt_tokens - 1`` tokens."""
    return max(0, prompt_tokens - 1) // block_size
