"""Seconds until each prefill worker would have a prompt's KV ready.

A prefill worker computes only the prompt tokens its prefix cache lacks, after the tokens
queued before them (the requests sent to it and not answered yet). One prefill's fixed cost
counts for each request ahead and for this one.
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
