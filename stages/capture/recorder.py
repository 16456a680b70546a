"""Worker side of the signature cache: expert picks added into a table indexed by KV block.

Each MoE router calls ``capture_fn(topk_ids)`` after choosing experts (vLLM's ``BaseRouter``
hook). We add every token's picks into ``table[block, layer, expert]`` where ``block`` is the
physical KV block its KV slot lands in. A request's prompt signature is then the sum of its
blocks' rows, so a prefix-cache hit reuses the counts its cached blocks got when they were
computed, and the signature stays exact. Writing slot 0 of a block means the block was
(re)allocated, so its row is reset first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import numpy as np
import torch

from stages.capture.messages import StepPlan, StepReport


def find_moe_routers(static_forward_context: Mapping[str, object]) -> list[tuple[int, object]]:
    """``(layer_id, router)`` of every vLLM MoE layer with the capture hook, in layer order."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    found = []
    for module in static_forward_context.values():
        router = getattr(module, "router", None)
        if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
            found.append((int(module.layer_id), router))
    found.sort(key=lambda item: item[0])
    return found


def current_slot_mapping() -> torch.Tensor | None:
    """This step's token -> KV slot map (the same for every attention layer of one group)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    mapping = get_forward_context().slot_mapping
    if isinstance(mapping, list):
        mapping = mapping[0] if mapping else {}
    for slots in mapping.values():
        return slots
    return None


class SignatureRecorder:
    """Owns the ``[num_blocks, L, E]`` table and turns a :class:`StepPlan` into a report.

    Inside the forward pass each MoE layer only copies its ``topk_ids`` into a preallocated
    ``[L, max_tokens, k]`` buffer (one small copy per layer, the kind of op a captured graph
    can replay); all accounting happens once per step, batched over layers, after the forward.
    """

    def __init__(self, num_blocks: int, block_size: int, max_tokens: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.num_layers = 0
        self.num_experts = 0
        self.top_k = 0
        self.table: torch.Tensor | None = None
        self._picks: torch.Tensor | None = None
        self._num_tokens = 0
        self._plan: StepPlan | None = None
        self._step_started = 0.0
        trace_dir = os.environ.get("ELDR_TRACE_DIR")
        self._trace_dir = Path(trace_dir) if trace_dir else None
        self._trace_step = 0

    # -- set-up ----------------------------------------------------------------------------
    def bind(self, static_forward_context: Mapping[str, object], device: torch.device) -> int:
        routers = find_moe_routers(static_forward_context)
        if not routers:
            return 0
        self.num_layers = len(routers)
        self.num_experts = int(routers[0][1].global_num_experts)
        self.top_k = int(routers[0][1].top_k)
        # int16 holds any count: one token picks an expert at most once per layer, and a block
        # has far fewer than 32k slots.
        self.table = torch.zeros(
            (self.num_blocks, self.num_layers, self.num_experts), dtype=torch.int16, device=device
        )
        self._picks = torch.zeros(
            (self.num_layers, self.max_tokens, self.top_k), dtype=torch.int64, device=device
        )
        self._layer_offsets = (
            torch.arange(self.num_layers, device=device) * self.num_experts
        ).view(-1, 1, 1)
        for index, (_, router) in enumerate(routers):
            router.set_capture_fn(partial(self._capture, index))
        return self.num_layers

    # -- per step ---------------------------------------------------------------------------
    def begin_step(self, plan: StepPlan) -> None:
        self._plan = plan
        self._num_tokens = 0
        self._step_started = time.perf_counter()

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self._plan is None or self._picks is None:  # profiling and warm-up runs: no plan
            return
        n = min(topk_ids.shape[0], self.max_tokens)
        self._picks[layer, :n].copy_(topk_ids[:n])
        self._num_tokens = n

    def end_step(self) -> StepReport | None:
        plan, self._plan = self._plan, None
        if plan is None or self.table is None or self._picks is None:
            return None
        n, self._num_tokens = self._num_tokens, 0
        report = StepReport()
        slots = current_slot_mapping()
        if n and slots is not None:
            self._account(plan, slots[:n].to(torch.int64), self._picks[:, :n], report)
        for req_id, blocks in plan.snapshots.items():
            rows = self.table[torch.tensor(blocks, dtype=torch.int64, device=self.table.device)]
            report.signatures[req_id] = rows.sum(0, dtype=torch.int32).cpu().numpy()
        if self._trace_dir is not None and n:
            self._dump_trace(self._picks[:, :n])
        if not (report.signatures or report.decode_counts or report.decode_steps):
            return None
        return report

    def _account(
        self, plan: StepPlan, slots: torch.Tensor, picks: torch.Tensor, report: StepReport
    ) -> None:
        """Add this step's picks into the table (and decode counts, decode-step stats)."""
        assert self.table is not None
        keep = slots >= 0
        if plan.skip_slots:
            # Slots re-written with the same KV (a full prefix hit recomputes its last token
            # into a cached block): their picks are already in the row.
            skip = torch.tensor(plan.skip_slots, dtype=torch.int64, device=slots.device)
            keep &= ~torch.isin(slots, skip)
        valid = torch.nonzero(keep).flatten()
        slots = slots[valid]
        ids = picks[:, valid]  # [L, T, k]
        blocks = slots // self.block_size
        fresh = blocks[(slots % self.block_size) == 0]
        if fresh.numel():
            self.table[fresh] = 0
        per_block = self.num_layers * self.num_experts
        flat = (blocks.view(1, -1, 1) * per_block + self._layer_offsets + ids).flatten()
        self.table.view(-1).index_add_(
            0, flat, torch.ones(flat.numel(), dtype=self.table.dtype, device=flat.device)
        )
        if plan.decode_slots:
            self._attribute_decode(plan, slots, ids, report)
        if plan.decode_only and ids.shape[1]:
            present = torch.zeros(
                (self.num_layers, self.num_experts), dtype=torch.bool, device=ids.device
            )
            present.scatter_(1, ids.reshape(self.num_layers, -1), True)
            if self.table.is_cuda:
                torch.cuda.synchronize()
            report.decode_steps = 1
            report.active_experts = present.sum(1).cpu().numpy()
            report.decode_seconds = time.perf_counter() - self._step_started
            report.decode_tokens = int(ids.shape[1])

    def _attribute_decode(
        self, plan: StepPlan, slots: torch.Tensor, ids: torch.Tensor, report: StepReport
    ) -> None:
        """Per-request decode counts: tokens matched to requests by their KV slot."""
        owners = sorted(
            (slot, row)
            for row, req_slots in enumerate(plan.decode_slots.values())
            for slot in req_slots
        )
        tracked = torch.tensor([s for s, _ in owners], dtype=torch.int64, device=slots.device)
        rows = torch.tensor([r for _, r in owners], dtype=torch.int64, device=slots.device)
        pos = torch.searchsorted(tracked, slots).clamp(max=len(owners) - 1)
        hit = tracked[pos] == slots
        tokens = torch.nonzero(hit).flatten()
        per_req = self.num_layers * self.num_experts
        flat = (rows[pos[hit]].view(1, -1, 1) * per_req + self._layer_offsets
                + ids[:, tokens]).flatten()
        counts = torch.zeros(len(plan.decode_slots) * per_req, dtype=torch.int32,
                             device=slots.device)
        counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.int32,
                                              device=flat.device))
        table = counts.view(-1, self.num_layers, self.num_experts).cpu().numpy()
        for row, req_id in enumerate(plan.decode_slots):
            report.decode_counts[req_id] = table[row]

    def _dump_trace(self, picks: torch.Tensor) -> None:
        """Debug aid for tests: this step's picks as ``[layers, tokens, top_k]``."""
        assert self._trace_dir is not None
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        path = self._trace_dir / f"step-{os.getpid()}-{self._trace_step:06d}.npy"
        np.save(path, picks.cpu().numpy().astype(np.int16))
        self._trace_step += 1
