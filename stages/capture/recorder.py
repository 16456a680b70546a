"""Worker side of the signature cache: expert picks added into a table indexed by KV block.

Each MoE router copies its top-k ids into a static per-layer buffer during the forward
(:mod:`stages.capture.topk_sink`). After the forward we add every token's picks into
``table[block, layer, expert]`` where ``block`` is the
physical KV block its KV slot lands in. A request's prompt signature is then the sum of its
blocks' rows, so a prefix-cache hit reuses the counts its cached blocks got when they were
computed, and the signature stays exact. Writing slot 0 of a block means the block was
(re)allocated, so its row is reset first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from stages.capture.host_copy import PendingCopy, StepTimer, to_device
from stages.capture.messages import DeviceResults, StepPlan, StepReport
from stages.capture.topk_sink import BUFFER_NAME, UNWRITTEN, TopkSink
from stages.vllm_compat import logical_num_experts


def find_moe_layers(
    static_forward_context: Mapping[str, object],
) -> tuple[list[tuple[int, torch.nn.Module]], list[str]]:
    """``(layer_id, layer)`` of every MoE layer with eldr's top-k buffer, in layer order, and
    the names of MoE layers without one (built before the plugin's hook was installed)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import (
        MoERunnerInterface,
    )

    found, missing = [], []
    for name, module in static_forward_context.items():
        if not isinstance(module, MoERunnerInterface):
            continue
        if hasattr(module, BUFFER_NAME):
            found.append((int(module.layer_id), module))
        else:
            missing.append(name)
    found.sort(key=lambda item: item[0])
    return found, missing


def _route_monolithic_kernel(layer: torch.nn.Module) -> None:
    """Kernels that route internally never call the router hook; vLLM gives them a sink."""
    from stages.vllm_compat import routed_experts_sink

    quant = getattr(layer, "_quant_method", None)
    if quant is None or not getattr(quant, "is_monolithic", False):
        return
    sink = routed_experts_sink()
    impl = getattr(getattr(quant, "moe_kernel", None), "impl", None)
    experts = getattr(impl, "fused_experts", None)
    supports = getattr(experts, "supports_routing_replay_capture", None)
    if sink is None or experts is None or supports is None or not supports():
        raise RuntimeError(
            f"MoE kernel {type(experts).__name__} routes inside the kernel and cannot report"
            " its expert ids with this vLLM release; start vLLM with another MoE backend"
        )
    layer.routed_experts.routing_sink = sink(experts.moe_config, TopkSink(layer))


def current_slot_mapping(layer_name: str | None = None) -> torch.Tensor | None:
    """This step's token -> KV slot map of ``layer_name``'s KV cache group (default: the first
    layer's). A step split into micro-batches is refused: each micro-batch writes its expert
    ids from row 0 of the same buffers, so they would not line up with the joined slots
    (engines with micro-batching are refused at start, :mod:`stages.capture.parallel`)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    mapping = get_forward_context().slot_mapping
    parts = mapping if isinstance(mapping, list) else [mapping]
    slices = [
        part[layer_name] if layer_name is not None else next(iter(part.values()))
        for part in parts if part
    ]
    if not slices:
        return None
    if len(slices) > 1:
        raise RuntimeError(
            f"eldr: this step ran in {len(slices)} micro-batches, whose expert ids eldr cannot"
            " line up with their KV slots; start the worker without --enable-dbo/--ubatch-size"
        )
    return slices[0]


class SignatureRecorder:
    """Owns the ``[num_blocks, L, E]`` table and turns a :class:`StepPlan` into a report.

    Inside the forward pass each MoE layer's router only copies its top-k ids into the layer's
    static buffer (:mod:`stages.capture.topk_sink`), which compiled graphs and CUDA graphs keep.
    All accounting happens once per step after the forward, from those buffers and the plan's
    token count: nothing depends on Python state that a compiled forward would not update.

    The per-step path never waits for the device (:mod:`stages.capture.host_copy`): what must
    not be counted (padding, a prefix hit's recomputed slots, rows the forward did not write)
    is sent to a spare row instead of being filtered out, index lists reach the device through
    non-blocking copies, and results come back in the report as :class:`DeviceResults`.
    """

    # Steps on which the buffers are first filled with UNWRITTEN and then checked: the first
    # ones of the worker (a hook missing from the graph shows at once), then a sample.
    CHECK_FIRST_STEPS = 32
    CHECK_EVERY = 64
    # On GPUs, decode-step statistics (distinct experts, step time) are taken on every 16th
    # decode step only: they are averages, and each costs a few small kernels and a copy.
    GPU_STATS_EVERY = 16

    def __init__(
        self, num_blocks: int, block_size: int, max_tokens: int, slot_layer: str | None = None
    ) -> None:
        self.num_blocks = num_blocks
        self.slot_layer = slot_layer  # a layer of the KV cache group signatures follow
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.num_layers = 0
        self.num_experts = 0
        self.top_k = 0
        self.layer_ids: list[int] = []  # transformer layer index of each MoE layer
        self.table: torch.Tensor | None = None
        self._buffers: list[torch.Tensor] = []
        self._plan: StepPlan | None = None
        self._timer: StepTimer | None = None
        self._steps_with_tokens = 0
        self._decode_steps = 0
        self._checking = False
        trace_dir = os.environ.get("ELDR_TRACE_DIR")
        self._trace_dir = Path(trace_dir) if trace_dir else None
        self._trace_step = 0

    # -- set-up ----------------------------------------------------------------------------
    def bind(self, static_forward_context: Mapping[str, object], device: torch.device) -> int:
        layers, missing = find_moe_layers(static_forward_context)
        if missing:
            raise RuntimeError(
                f"eldr: {len(missing)} MoE layers (e.g. {missing[0]}) were built without eldr's"
                " top-k buffer; the eldr vLLM plugin must be loaded in the worker (is"
                " VLLM_PLUGINS set without 'eldr'?)"
            )
        for _, layer in layers:
            _route_monolithic_kernel(layer)
        return self.bind_layers(layers, device)

    def bind_layers(self, layers: list[tuple[int, torch.nn.Module]], device: torch.device) -> int:
        """Read the given ``(layer_id, layer)`` buffers, in order; returns L."""
        if not layers:
            return 0
        self.layer_ids = [layer_id for layer_id, _ in layers]
        self._buffers = [getattr(layer, BUFFER_NAME) for _, layer in layers]
        self.num_layers = len(layers)
        self.num_experts = logical_num_experts(layers[0][1])
        self.top_k = int(self._buffers[0].shape[1])
        # int16 holds any count: one token picks an expert at most once per layer, and a block
        # has far fewer than 32k slots.
        # One spare row past the last block (see _account).
        self.table = torch.zeros(
            (self.num_blocks + 1, self.num_layers, self.num_experts), dtype=torch.int16,
            device=device,
        )
        self._layer_offsets = (
            torch.arange(self.num_layers, device=device) * self.num_experts
        ).view(-1, 1, 1)
        self._timer = StepTimer(device)
        return self.num_layers

    # -- per step ---------------------------------------------------------------------------
    def begin_step(self, plan: StepPlan) -> None:
        self._plan = plan
        if self._timer is not None:
            self._timer.start()
        n = min(plan.num_tokens, self.max_tokens)
        self._checking = n > 0 and (
            self._steps_with_tokens < self.CHECK_FIRST_STEPS
            or self._steps_with_tokens % self.CHECK_EVERY == 0
        )
        if n:
            self._steps_with_tokens += 1
        if self._checking:
            for buffer in self._buffers:
                buffer[:n].fill_(UNWRITTEN)

    def end_step(self, slots: torch.Tensor | None = None) -> StepReport | None:
        """This step's report; ``slots`` defaults to the forward context's token -> KV slot map."""
        plan, self._plan = self._plan, None
        if plan is None or self.table is None:
            return None
        n = min(plan.num_tokens, self.max_tokens)
        results: dict[str, torch.Tensor] = {}
        step = DeviceResults(copy=PendingCopy({}))
        slots = current_slot_mapping(self.slot_layer) if slots is None else slots
        if n and slots is not None:
            picks = torch.stack([buffer[:n] for buffer in self._buffers]).to(torch.int64)
            if self._checking:
                # The forward did not run the hook (a graph traced or cached without it): the
                # rows it left unwritten go to the spare row, and the report says so.
                results["unwritten"] = (picks == UNWRITTEN).any()
            self._account(plan, slots[:n].to(torch.int64), picks, results, step)
            if self._trace_dir is not None:
                self._dump_trace(picks)
        if plan.snapshots:
            step.signature_ids = list(plan.snapshots)
            results["signatures"] = self._sum_blocks(list(plan.snapshots.values()))
        if plan.block_snapshots:
            # Blocks that became full in this step, for expert events: a gather and a
            # non-blocking copy, read where the step's outputs are already on the host.
            step.block_hashes = list(plan.block_snapshots)
            rows = to_device(list(plan.block_snapshots.values()), self.table.device)
            results["blocks"] = self.table.index_select(0, rows)
        if not results:
            return None
        step.copy = PendingCopy(results)
        return StepReport(moe_layers=tuple(self.layer_ids), pending=step)

    def _sum_blocks(self, requests: list[list[int]]) -> torch.Tensor:
        """``[R, L, E]`` int32: each request's blocks' rows summed, in one gather."""
        assert self.table is not None
        blocks = [block for request in requests for block in request]
        owners = [row for row, request in enumerate(requests) for _ in request]
        both = to_device(blocks + owners, self.table.device)
        rows = self.table.index_select(0, both[: len(blocks)]).to(torch.int32)
        sums = torch.zeros((len(requests), self.num_layers, self.num_experts),
                           dtype=torch.int32, device=self.table.device)
        return sums.index_add_(0, both[len(blocks):], rows)

    def _account(
        self, plan: StepPlan, slots: torch.Tensor, picks: torch.Tensor,
        results: dict[str, torch.Tensor], step: DeviceResults,
    ) -> None:
        """Add this step's picks into the table (and decode counts, decode-step stats)."""
        assert self.table is not None
        keep = slots >= 0
        if plan.skip_slots:
            # Slots re-written with the same KV (a full prefix hit recomputes its last token
            # into a cached block): their picks are already in the row.
            skip = to_device(sorted(plan.skip_slots), slots.device)
            at = torch.searchsorted(skip, slots).clamp_(max=len(skip) - 1)
            keep &= skip[at] != slots
        spare = self.num_blocks  # the table's extra row: absorbs what must not be counted
        blocks = torch.where(keep, slots // self.block_size, spare)
        # Writing slot 0 of a block means the block was (re)allocated: reset its row first.
        fresh = keep & (slots % self.block_size == 0)
        self.table.index_fill_(0, torch.where(fresh, blocks, spare), 0)
        # An id the forward did not write (UNWRITTEN) or cannot have written is never counted.
        counted = keep.view(1, -1, 1) & (picks >= 0) & (picks < self.num_experts)
        per_block = self.num_layers * self.num_experts
        flat = torch.where(
            counted, blocks.view(1, -1, 1) * per_block + self._layer_offsets + picks,
            spare * per_block,
        ).flatten()
        self.table.view(-1).index_add_(
            0, flat, torch.ones(flat.numel(), dtype=self.table.dtype, device=flat.device)
        )
        if plan.decode_slots:
            step.decode_ids = list(plan.decode_slots)
            results["decode_counts"] = self._attribute_decode(plan, slots, picks, counted)
        if plan.decode_only:
            self._decode_steps += 1
            if self.table.device.type == "cpu" or self._decode_steps % self.GPU_STATS_EVERY == 0:
                self._decode_stats(keep, picks, counted, results, step)

    def _decode_stats(
        self, keep: torch.Tensor, picks: torch.Tensor, counted: torch.Tensor,
        results: dict[str, torch.Tensor], step: DeviceResults,
    ) -> None:
        """Distinct experts per layer and the time of this decode step."""
        assert self._timer is not None
        # Left-out tokens pick the spare column E, dropped before counting.
        ids = torch.where(counted, picks, self.num_experts)
        present = torch.zeros(
            (self.num_layers, self.num_experts + 1), dtype=torch.bool, device=ids.device
        )
        present.scatter_(1, ids.reshape(self.num_layers, -1), True)
        results["active"] = present[:, : self.num_experts].sum(1)
        results["tokens"] = keep.sum()
        step.step_time = self._timer.stop()

    def _attribute_decode(
        self, plan: StepPlan, slots: torch.Tensor, picks: torch.Tensor, counted: torch.Tensor
    ) -> torch.Tensor:
        """Per-request decode counts ``[R, L, E]``: tokens matched to requests by KV slot."""
        owners = sorted(
            (slot, row)
            for row, req_slots in enumerate(plan.decode_slots.values())
            for slot in req_slots
        )
        both = to_device([s for s, _ in owners] + [r for _, r in owners], slots.device)
        tracked, rows = both[: len(owners)], both[len(owners):]
        pos = torch.searchsorted(tracked, slots).clamp_(max=len(owners) - 1)
        hit = tracked[pos] == slots
        # Tokens of no tracked request (prompt tokens, padding) land in a spare request row.
        spare = len(plan.decode_slots)
        owner = torch.where(hit, rows[pos], spare)
        per_req = self.num_layers * self.num_experts
        flat = torch.where(
            counted & hit.view(1, -1, 1),
            owner.view(1, -1, 1) * per_req + self._layer_offsets + picks,
            spare * per_req,
        ).flatten()
        counts = torch.zeros((spare + 1) * per_req, dtype=torch.int32, device=slots.device)
        counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.int32,
                                              device=flat.device))
        return counts.view(-1, self.num_layers, self.num_experts)[:spare]

    def _dump_trace(self, picks: torch.Tensor) -> None:
        """Debug aid for tests: this step's picks as ``[layers, tokens, top_k]``."""
        assert self._trace_dir is not None
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        path = self._trace_dir / f"step-{os.getpid()}-{self._trace_step:06d}.npy"
        np.save(path, picks.cpu().numpy().astype(np.int16))
        self._trace_step += 1
