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
    """Owns the ``[num_blocks, L, E]`` table and turns a :class:`StepPlan` into a report."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = 0
        self.num_experts = 0
        self.table: torch.Tensor | None = None
        self._plan: StepPlan | None = None
        self._step_started = 0.0
        self._prepared = False
        trace_dir = os.environ.get("ELDR_TRACE_DIR")
        self._trace_dir = Path(trace_dir) if trace_dir else None
        self._trace: list[torch.Tensor] = []
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
        for index, (_, router) in enumerate(routers):
            router.set_capture_fn(partial(self._capture, index))
        return self.num_layers

    # -- per step ---------------------------------------------------------------------------
    def begin_step(self, plan: StepPlan) -> None:
        self._plan = plan
        self._prepared = False
        self._step_started = time.perf_counter()
        if plan.decode_only:
            self._active = torch.zeros(self.num_layers, dtype=torch.int64)

    def _prepare(self, num_tokens: int) -> bool:
        """Once per step, at the first MoE layer: map tokens to table rows, reset new blocks."""
        self._prepared = True
        slots = current_slot_mapping()
        if slots is None or self.table is None:
            self._valid = None
            return False
        slots = slots[:num_tokens].to(torch.int64)
        keep = slots >= 0
        plan = self._plan
        assert plan is not None
        if plan.skip_slots:
            # Slots re-written with the same KV (a full prefix hit recomputes its last token
            # into a cached block): their picks are already in the row.
            skip = torch.tensor(plan.skip_slots, dtype=torch.int64, device=slots.device)
            keep &= ~torch.isin(slots, skip)
        self._valid = torch.nonzero(keep).flatten()
        slots = slots[self._valid]
        blocks = slots // self.block_size
        fresh = blocks[(slots % self.block_size) == 0]
        if fresh.numel():
            self.table[fresh] = 0
        per_block = self.num_layers * self.num_experts
        self._row_base = (blocks * per_block).unsqueeze(1)
        self._decode_rows = None
        if plan.decode_slots:
            owners = [(slot, row) for row, req_slots in enumerate(plan.decode_slots.values())
                      for slot in req_slots]
            owners.sort()
            tracked = torch.tensor([s for s, _ in owners], dtype=torch.int64, device=slots.device)
            rows = torch.tensor([r for _, r in owners], dtype=torch.int64, device=slots.device)
            pos = torch.searchsorted(tracked, slots).clamp(max=len(owners) - 1)
            hit = tracked[pos] == slots
            self._decode_tokens = torch.nonzero(hit).flatten()
            self._decode_rows = (rows[pos[hit]] * per_block).unsqueeze(1)
            self._decode_acc = torch.zeros(
                len(plan.decode_slots) * per_block, dtype=torch.int32, device=slots.device
            )
        return True

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self._plan is None:  # profiling and warm-up runs carry no plan
            return
        if not self._prepared and not self._prepare(topk_ids.shape[0]):
            return
        if self._valid is None:
            return
        ids = topk_ids[self._valid].to(torch.int64)
        offset = layer * self.num_experts
        assert self.table is not None
        flat = (self._row_base + offset + ids).flatten()
        self.table.view(-1).index_add_(
            0, flat, torch.ones(flat.numel(), dtype=self.table.dtype, device=flat.device)
        )
        if self._decode_rows is not None and self._decode_tokens.numel():
            dec = (self._decode_rows + offset + ids[self._decode_tokens]).flatten()
            self._decode_acc.index_add_(
                0, dec, torch.ones(dec.numel(), dtype=torch.int32, device=dec.device)
            )
        if self._plan.decode_only:
            present = torch.bincount(ids.flatten(), minlength=self.num_experts) > 0
            self._active[layer] += int(present.sum())
        if self._trace_dir is not None:
            self._trace.append(ids.cpu())

    def end_step(self) -> StepReport | None:
        plan, self._plan = self._plan, None
        if plan is None or self.table is None:
            return None
        report = StepReport()
        for req_id, blocks in plan.snapshots.items():
            rows = self.table[torch.tensor(blocks, dtype=torch.int64, device=self.table.device)]
            report.signatures[req_id] = rows.sum(0, dtype=torch.int32).cpu().numpy()
        if plan.decode_slots and self._prepared and self._decode_rows is not None:
            acc = self._decode_acc.view(-1, self.num_layers, self.num_experts).cpu().numpy()
            for row, req_id in enumerate(plan.decode_slots):
                report.decode_counts[req_id] = acc[row]
        if plan.decode_only and self._prepared:
            if self.table.is_cuda:
                torch.cuda.synchronize()
            report.decode_steps = 1
            report.active_experts = self._active.numpy()
            report.decode_seconds = time.perf_counter() - self._step_started
            report.decode_tokens = int(self._valid.numel()) if self._valid is not None else 0
        if self._trace_dir is not None and self._trace:
            self._dump_trace()
        if not (report.signatures or report.decode_counts or report.decode_steps):
            return None
        return report

    def _dump_trace(self) -> None:
        """Debug aid for tests: this step's picks as ``[layers, tokens, top_k]``."""
        assert self._trace_dir is not None
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        picks = torch.stack(self._trace).numpy().astype(np.int16)
        np.save(self._trace_dir / f"step-{os.getpid()}-{self._trace_step:06d}.npy", picks)
        self._trace_step += 1
        self._trace = []
