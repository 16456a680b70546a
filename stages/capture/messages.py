"""What the scheduler-side and worker-side halves of the eldr connector tell each other.

The scheduler knows requests and their KV blocks; the worker sees the tokens' expert picks.
Each engine step the scheduler sends a :class:`StepPlan` (which requests finish their prompt
in this step, which slots hold decode tokens to attribute) and the worker answers with a
:class:`StepReport` (the signatures and per-request decode counts it summed, plus decode-step
statistics). Both cross process boundaries with vLLM's own metadata, so they hold only plain
Python and numpy values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class StepPlan(KVConnectorMetadata):
    # req_id -> the KV block ids holding its prompt, for requests whose prompt completes now
    snapshots: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> KV slots of this step's decode tokens (only when decode counting is on)
    decode_slots: dict[str, list[int]] = field(default_factory=dict)
    # slots re-written with KV already in the table (full prefix hit): do not add again
    skip_slots: list[int] = field(default_factory=list)
    # every token of this step is a decode token: count its distinct experts
    decode_only: bool = False
    # tokens the forward runs (a CUDA graph may pad its batch beyond them)
    num_tokens: int = 0


@dataclass
class StepReport(KVConnectorWorkerMetadata):
    signatures: dict[str, np.ndarray] = field(default_factory=dict)  # int32 [L, E]
    decode_counts: dict[str, np.ndarray] = field(default_factory=dict)  # int32 [L, E]
    decode_steps: int = 0
    active_experts: np.ndarray | None = None  # int64 [L]: sum over decode steps
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    # steps whose forward did not write the top-k buffers (hook missing from the graph)
    unrecorded_steps: int = 0
    # transformer layer index of each signature row, sent with signatures
    moe_layers: tuple[int, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Tensor-parallel ranks route every token identically, so their reports agree;
        # keep one rather than double counting.
        return self
