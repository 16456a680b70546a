"""The default threshold of conditional disaggregation (eldr-kv's ``local_prefill_below``) from
the engine's measured costs.

A request whose decode worker lacks ``n`` of its prompt tokens can take either path:
- remote: a prefill worker computes them (at best only them: it may lack more) and the decode
  worker pulls them, so the request waits ``prefill_base_s + prefill_per_token_s x n`` plus
  the hand-off, ``kv_transfer_base_s + kv_transfer_per_token_s x n``;
- local: the decode worker computes them in its next step, so the request and the ``b``
  running beside it all wait ``prefill_per_token_s x n``.
Local costs the requests' time no more than remote while
``b x prefill_per_token_s x n <= prefill_base_s + kv_transfer_base_s + kv_transfer_per_token_s
x n``: the default threshold is the largest such ``n`` (plus one: a worker prefills when it
lacks *fewer* than the threshold), at the decode batch ``b`` the workers run.
"""

from __future__ import annotations

import math

from stages.errors import EldrError
from stages.routing.cost_model import CostModel

# A pull's fixed cost (NIXL handshake, notification): the simulator's default too.
KV_TRANSFER_BASE_S = 0.002


def default_local_prefill_below(cost: CostModel, decode_batch: int,
                                kv_transfer_base_s: float = KV_TRANSFER_BASE_S) -> int | None:
    """The threshold at a decode batch of ``decode_batch`` (see the module's docstring); None
    when a local prefill is never the dearer path (its per-token cost to the batch is no
    more than the hand-off's)."""
    if decode_batch < 1:
        raise EldrError(f"decode batch must be >= 1, got {decode_batch}")
    per_token = decode_batch * cost.prefill_per_token_s - cost.kv_transfer_per_token_s
    if per_token <= 0:
        return None
    return math.floor((cost.prefill_base_s + kv_transfer_base_s) / per_token) + 1
