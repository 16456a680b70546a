"""Seconds until each prefill worker would have a prompt's KV ready.

A prefill worker computes only the prompt tokens its prefix cache lacks, after the tokens
queued before them (the requests sent to it and not answered yet). One prefill's fixed cost
counts for each request ahead and for this one. Workers that share compute (cores or a GPU)
take turns on it, so what is queued ahead of a worker is its whole group's (``shared_queue``).
"""

from __future__ import annotations

import numpy as np

from stages.routing.cost_model import CostModel


def prefill_ready_s(prompt_tokens: int, cached_tokens: np.ndarray, queued_tokens: np.ndarray,
                    queued_requests: np.ndarray, cost: CostModel) -> np.ndarray:
    """[P] seconds."""
    lacking = np.maximum(prompt_tokens - cached_tokens, 0)
    return ((queued_tokens + lacking) * cost.prefill_per_token_s
            + (queued_requests + 1) * cost.prefill_base_s)


def shared_queue(queued: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[P] what is queued on each worker's compute: ``queued`` summed over the workers sharing
    it (``groups[w]``: its group, 0-based)."""
    return np.bincount(groups, weights=queued)[groups].astype(queued.dtype)
