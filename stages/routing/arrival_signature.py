"""A prompt's signature when it arrives, before any prefill: what the proxy routes its decode on
under ``decode_choice = "arrival"``.

The prompt's leading blocks that the workers' expert events know (``kv.block_experts``) give
the exact counts of its cached prefix; the token predictor the artifact carries
(``signature.token_predictor``) estimates the tokens after them. The sum is in a prefill
signature's units (int ``[L, E]``: each token's top-k picks per layer), so a decode policy
takes it where it takes the prefill's (``RoutingRequest.counts``, through
``routing.inputs.routing_inputs``).

Without a predictor (an artifact fit before it), the uncached tail is estimated from the
prefix itself: its per-token routing carried over the tail's length. A prompt with neither
a known first block nor a predictor has no signature at arrival (None): the policy routes it
on KV and load alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from stages.routing.kv.block_experts import BlockExperts
from stages.signature.token_predictor import TokenPredictor


class ArrivalSignature(NamedTuple):
    counts: np.ndarray | None  # int32 [L, E], or None when nothing is known of the prompt
    cached_tokens: int  # leading prompt tokens whose counts are exact (expert events)


def arrival_signature(
    token_ids: Sequence[int] | np.ndarray,
    block_hashes: Sequence[int],
    block_size: int,
    index: BlockExperts,
    predictor: TokenPredictor | None,
) -> ArrivalSignature:
    """The signature of a prompt of ``token_ids`` at arrival.

    ``block_hashes``: its full blocks' hashes as ``kv.block_hashes.BlockHasher`` computes them
    for the workers' ``block_size``; the leading ones ``index`` knows are its cached prefix.
    """
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    ids = np.asarray(token_ids, dtype=np.int64).ravel()
    if len(block_hashes) * block_size > len(ids):
        raise ValueError(f"{len(block_hashes)} blocks of {block_size} tokens for a"
                         f" {len(ids)}-token prompt")
    cached = index.signature_of(block_hashes)
    cached_tokens = 0 if cached is None else index.leading(block_hashes) * block_size
    if predictor is not None:
        if cached is not None and cached.shape != predictor.shape:
            # Expert events of another model than the artifact's: the prefix cannot be used.
            cached, cached_tokens = None, 0
        counts = predictor.predict_signature(ids, cached, cached_tokens)
    elif cached is None:
        return ArrivalSignature(None, 0)
    else:
        # No predictor: the prefix's routing per token, over the whole prompt.
        counts = cached * (len(ids) / cached_tokens)
    return ArrivalSignature(np.rint(counts).astype(np.int32), cached_tokens)
