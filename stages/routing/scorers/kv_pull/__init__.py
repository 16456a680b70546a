"""Seconds each decode worker needs to pull the prompt's KV it does not hold.

NixlConnector's decode side pulls only the prompt tokens it has not computed itself (vLLM's
``get_num_new_matched_tokens``: prompt length minus locally cached tokens), so a worker that
holds a conversation's earlier turns pulls only the new part.
"""

from __future__ import annotations

import numpy as np


def kv_pull_s(prompt_tokens: int, cached_tokens: np.ndarray | None,
              per_token_s: float) -> np.ndarray | float:
    """[W] seconds (a scalar 0 when nothing is known of the prompt)."""
    if cached_tokens is None or prompt_tokens <= 0:
        return 0.0
    lacking = np.maximum(prompt_tokens - cached_tokens, 0)
    return lacking * per_token_s
