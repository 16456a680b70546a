"""What the scheduler-side and worker-side halves of the eldr connector tell each other.

The scheduler knows requests and their KV blocks; the worker sees the tokens' expert picks.
Each engine step the scheduler sends a :class:`StepPlan` (which requests finish their prompt
in this step, which slots hold decode tokens to attribute) and the worker answers with a
:class:`StepReport` (the signatures and per-request decode counts it summed, plus decode-step
statistics). Both cross process boundaries with vLLM's own metadata.

A report leaves the worker before the device has finished computing it (see
:mod:`stages.capture.host_copy`): its device results ride along as :class:`DeviceResults` and
are read into the plain fields by :meth:`StepReport.resolve`, which the scheduler calls before
reading, and which pickling calls first (the worker's output thread pickles a report only after
the step's outputs have reached the host). Across processes a report holds only plain Python
and numpy values.

With pipeline parallelism each stage records its own MoE layers and vLLM merges the stages'
reports with :meth:`StepReport.aggregate`: rows are placed by transformer layer index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from stages.capture.host_copy import PendingCopy, StepTime


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
    # block hash -> KV block id, for blocks that become full in this step (only when the
    # worker publishes expert events): their rows, once this step is added, come back
    block_snapshots: dict[int, int] = field(default_factory=dict)


@dataclass
class DeviceResults:
    """A step's results still on their way from the device, and whom they belong to."""

    copy: PendingCopy
    signature_ids: list[str] = field(default_factory=list)  # rows of "signatures"
    decode_ids: list[str] = field(default_factory=list)  # rows of "decode_counts"
    block_hashes: list[int] = field(default_factory=list)  # rows of "blocks"
    step_time: StepTime | None = None  # with "active" and "tokens": decode-step statistics

    def fill(self, report: StepReport) -> None:
        arrays = self.copy.wait()
        for row, req_id in enumerate(self.signature_ids):
            report.signatures[req_id] = arrays["signatures"][row]
        for row, req_id in enumerate(self.decode_ids):
            report.decode_counts[req_id] = arrays["decode_counts"][row]
        for row, block_hash in enumerate(self.block_hashes):
            report.block_counts[block_hash] = arrays["blocks"][row]
        if "unwritten" in arrays and bool(arrays["unwritten"]):
            report.unrecorded_steps = 1
        if self.step_time is not None and int(arrays["tokens"]) > 0:
            report.decode_steps = 1
            report.active_experts = arrays["active"].astype(np.int64)
            report.decode_tokens = int(arrays["tokens"])
            report.decode_seconds = self.step_time.seconds()


@dataclass
class StepReport(KVConnectorWorkerMetadata):
    signatures: dict[str, np.ndarray] = field(default_factory=dict)  # int32 [L, E]
    decode_counts: dict[str, np.ndarray] = field(default_factory=dict)  # int32 [L, E]
    # block hash -> the block's counts (int16 [L, E]), for StepPlan.block_snapshots
    block_counts: dict[int, np.ndarray] = field(default_factory=dict)
    decode_steps: int = 0
    active_experts: np.ndarray | None = None  # int64 [L]: sum over decode steps
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    # steps whose forward did not write the top-k buffers (hook missing from the graph)
    unrecorded_steps: int = 0
    # transformer layer index of each row of every [L, E] table above
    moe_layers: tuple[int, ...] = ()
    pending: DeviceResults | None = field(default=None, repr=False, compare=False)

    def resolve(self) -> StepReport:
        """Read the device results into the fields (waits for them if still in flight)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.fill(self)
        return self

    def __getstate__(self) -> dict[str, Any]:
        self.resolve()
        return dict(self.__dict__)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, StepReport):
            return self
        self.resolve()
        other.resolve()
        if not other.moe_layers or set(other.moe_layers) == set(self.moe_layers):
            # Another rank of the same layers (tensor parallel ranks route every token alike;
            # only one of them records): nothing to add.
            return self
        if not self.moe_layers:
            return other
        if set(self.moe_layers) & set(other.moe_layers):
            raise RuntimeError(
                f"eldr: two ranks reported overlapping MoE layers {self.moe_layers} and"
                f" {other.moe_layers}: this parallel layout is not supported"
            )
        return merge_stages(self, other)


def merge_stages(a: StepReport, b: StepReport) -> StepReport:
    """One report from two pipeline stages' reports of the same step (disjoint layers)."""
    layers = a.moe_layers + b.moe_layers
    order = np.argsort(layers, kind="stable")

    def rows(x: dict[Any, np.ndarray], y: dict[Any, np.ndarray]) -> dict[Any, np.ndarray]:
        merged = {}
        for req_id in x.keys() | y.keys():
            # A request one stage did not report gets zero rows there, which the ledger
            # counts as a failed signature rather than guessing.
            left = x.get(req_id, np.zeros((len(a.moe_layers), _experts(x, y)), np.int32))
            right = y.get(req_id, np.zeros((len(b.moe_layers), _experts(x, y)), np.int32))
            merged[req_id] = np.concatenate([left, right])[order]
        return merged

    active = None
    if a.active_experts is not None and b.active_experts is not None:
        active = np.concatenate([a.active_experts, b.active_experts])[order]
    return StepReport(
        signatures=rows(a.signatures, b.signatures),
        decode_counts=rows(a.decode_counts, b.decode_counts),
        block_counts=rows(a.block_counts, b.block_counts),
        decode_steps=min(a.decode_steps, b.decode_steps) if active is not None else 0,
        active_experts=active,
        # The stages run one after the other for a step's tokens.
        decode_seconds=a.decode_seconds + b.decode_seconds if active is not None else 0.0,
        decode_tokens=max(a.decode_tokens, b.decode_tokens) if active is not None else 0,
        unrecorded_steps=max(a.unrecorded_steps, b.unrecorded_steps),
        moe_layers=tuple(int(layers[i]) for i in order),
    )


def _experts(*tables: dict[Any, np.ndarray]) -> int:
    for table in tables:
        for counts in table.values():
            return int(counts.shape[1])
    return 0
