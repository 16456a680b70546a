"""Scheduler side of the signature cache: which request owns which blocks and tokens.

The scheduler knows, for every request, its KV blocks and how far its prompt got; the worker
knows the expert picks. Each step the ledger plans what the worker must sum (prompts that
complete now, slots of decode tokens to attribute) and files the worker's answers per request.

``request_finished`` runs *before* the same step's worker report is applied (vLLM's scheduler
frees finished requests first, then calls ``update_connector_output``), so a prefill-only
request (``max_tokens=1``, the PD case) finishes before its signature arrives. The ledger hands
vLLM a dict it keeps a reference to and fills it when the report lands, still inside the same
``update_from_output`` call, before the engine serialises the outputs.

A row of the worker's table holds a block's counts only if this engine computed the block from
its slot 0 (the worker resets a row there). A block whose KV a connector loaded (NixlConnector
pulling a prompt from a prefill worker) keeps the counts of its previous occupant, or zeros; the
ledger calls such blocks foreign until this engine computes their slot 0 again, and a signature
or an expert event that would read a foreign row is unknown: left out and counted, never sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stages.capture.messages import StepPlan, StepReport
from stages.routing.kv.block_hashes import external_hash
from stages.signature import wire

DECODE_COUNTS_KEY = "eldr_decode_counts"


@dataclass
class _Tracked:
    prompt_len: int
    block_ids: list[int]
    computed: int  # tokens computed once this step's forward is done
    remote: bool = False  # KV came from another instance: our table never saw its prompt
    unknown: bool = False  # its prompt holds a foreign block: no signature to give
    # The name a proxy asked for its decode counts under (RECORD_KEY), remote or not.
    record_as: str | None = None
    output_tokens: int = 0
    signature: np.ndarray | None = None
    decode_counts: np.ndarray | None = None
    pending_params: dict[str, Any] | None = field(default=None, repr=False)


class SignatureLedger:
    def __init__(
        self, block_size: int, shape: tuple[int, int] | None, count_decode: bool, group: int = 0,
        publish_blocks: bool = False,
    ) -> None:
        self.block_size = block_size
        self.group = group  # the KV cache group whose blocks hold signatures (kv_group)
        self.shape = shape  # (L, E) once known from a report
        self.count_decode = count_decode
        self._requests: dict[str, _Tracked] = {}
        self._awaiting: dict[str, _Tracked] = {}  # finished, waiting for this step's report
        self._remote: set[str] = set()
        self._record: dict[str, str] = {}  # asked for decode counts, not yet scheduled
        self._recording: dict[str, _Tracked] = {}  # finished; counts complete after this step
        # (name, prompt tokens, output tokens, decode counts) of finished recorded requests.
        self.recorded: list[tuple[str, int, int, np.ndarray]] = []
        self.moe_layers: tuple[int, ...] = ()  # as the worker built them, once it reported
        # Prompts whose signature came back empty: the recording hook did not run for them.
        self.zero_signatures = 0
        # Blocks whose rows do not count their tokens: a connector loaded their KV and this
        # engine has not computed their slot 0 since (see the module's docstring).
        self._foreign: set[int] = set()
        # req_id -> the signature group's blocks allocated at admission (not prefix-cache hits)
        self._admitted: dict[str, list[int]] = {}
        # Prompts and full blocks that would have read a foreign row: unknown, not sent.
        self.unknown_signatures = 0
        self.unknown_blocks = 0
        # Expert events: each request's block hashes (vLLM's own list, which it extends as
        # tokens arrive), and the counts of blocks that became full, until published.
        self.publish_blocks = publish_blocks
        # req_id -> (its block hashes, the first block this engine computes whole)
        self._hashes: dict[str, tuple[list[Any], int]] = {}
        self.stored_blocks: dict[int, np.ndarray] = {}

    def track_hashes(self, req_id: str, block_hashes: list[Any], remote_prompt_len: int = 0
                     ) -> None:
        """``block_hashes``: the request's ``Request.block_hashes`` (kept by reference);
        ``remote_prompt_len``: prompt tokens whose KV another engine computed (a decode worker's
        request): the table never saw them, so no block holding one is published."""
        if self.publish_blocks:
            first_whole = -(-remote_prompt_len // self.block_size)
            known = self._hashes.get(req_id)
            # vLLM admits a request whose KV it loads twice (before and after the load), and
            # NixlConnector clears do_remote_prefill in between: the first call's length stays.
            if known is not None:
                first_whole = max(first_whole, known[1])
            self._hashes[req_id] = (block_hashes, first_whole)

    def mark_remote(self, req_id: str) -> None:
        """The request's KV arrives from a prefill instance; there is nothing to sum here."""
        self._remote.add(req_id)

    def admitted(self, req_id: str, new_blocks: list[int], remote: bool) -> None:
        """vLLM allocated the request's blocks: ``new_blocks`` are those that were not prefix-cache
        hits. Those of them below the tokens vLLM counts as computed when it schedules the
        request were filled by a connector, not by this engine (see :meth:`plan`). Only the
        first call of a request counts: after a load, the loaded blocks are cached ones."""
        if remote:
            self.mark_remote(req_id)
        self._admitted.setdefault(req_id, new_blocks)

    def mark_record(self, req_id: str, name: str) -> None:
        """Count the request's decode tokens per expert and hand them over under ``name`` when
        it finishes (``recorded``), whether or not this engine ran its prompt."""
        self._record[req_id] = name

    def plan(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan(num_tokens=int(scheduler_output.total_num_scheduled_tokens))
        scheduled = scheduler_output.num_scheduled_tokens
        remote, record = self._remote, self._record
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
            remote.discard(req_id)
            record.pop(req_id, None)
            self._hashes.pop(req_id, None)
            self._admitted.pop(req_id, None)
        self._mark_loaded(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            prompt_len = len(new.prompt_token_ids or ())
            tracked = _Tracked(
                prompt_len=prompt_len,
                block_ids=list(new.block_ids[self.group]),
                computed=new.num_computed_tokens,
                remote=new.req_id in remote,
                record_as=record.pop(new.req_id, None),
            )
            self._requests[new.req_id] = tracked
            self._plan_request(plan, new.req_id, tracked, scheduled.get(new.req_id, 0), True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed:
                tracked.block_ids = list(new_blocks[self.group]) if new_blocks else []
                tracked.decode_counts = None  # recomputation re-adds the decode tokens
            elif new_blocks:
                tracked.block_ids.extend(new_blocks[self.group])
            tracked.computed = cached.num_computed_tokens[i]
            self._plan_request(plan, req_id, tracked, scheduled.get(req_id, 0), resumed)
        plan.decode_only = bool(scheduled) and all(
            (t := self._requests.get(r)) is not None and t.computed - n >= t.prompt_len
            for r, n in scheduled.items()
        )
        return plan

    def _mark_loaded(self, scheduler_output: Any) -> None:
        """Blocks of the requests starting (or restarting) in this step that were allocated new
        yet hold tokens vLLM counts as computed: a connector loaded them. Marked for every
        request before any is planned: a request scheduled later in the same step may hit them."""
        cached = scheduler_output.scheduled_cached_reqs
        starting = [(new.req_id, list(new.block_ids[self.group]), new.num_computed_tokens)
                    for new in scheduler_output.scheduled_new_reqs]
        starting += [(req_id, list(cached.new_block_ids[i][self.group])
                      if cached.new_block_ids[i] else [], cached.num_computed_tokens[i])
                     for i, req_id in enumerate(cached.req_ids)
                     if req_id in cached.resumed_req_ids]
        for req_id, block_ids, computed in starting:
            new_blocks = self._admitted.pop(req_id, None)
            if not new_blocks or not computed:
                continue
            # Block i's slot 0 is position i * block_size: below ``computed``, not run here.
            below = set(block_ids[: -(-computed // self.block_size)])
            self._foreign.update(below.intersection(new_blocks))

    def _plan_request(
        self, plan: StepPlan, req_id: str, tracked: _Tracked, num_tokens: int, first: bool
    ) -> None:
        start = tracked.computed
        end = start + num_tokens
        tracked.computed = end
        if num_tokens == 0:
            return
        if self._foreign:
            # The worker resets the row of every block whose slot 0 this step computes.
            bs = self.block_size
            computed_from = -(-start // bs)
            upto = min(-(-end // bs), len(tracked.block_ids))
            self._foreign.difference_update(tracked.block_ids[computed_from:upto])
        decode_start = max(start, tracked.prompt_len)
        if (self.count_decode or tracked.record_as is not None) and decode_start < end:
            plan.decode_slots[req_id] = [self._slot(tracked, p) for p in range(decode_start, end)]
        if self.publish_blocks:
            self._plan_blocks(plan, req_id, tracked, start, end)
        if first and start % self.block_size:
            # vLLM recomputes the last prompt token of a full prefix hit (or of a loaded prompt)
            # into its cached block: its KV, and its row's counts, are there already.
            boundary = min(end, (start // self.block_size + 1) * self.block_size)
            plan.skip_slots.extend(self._slot(tracked, p) for p in range(start, boundary))
        if tracked.remote:
            return
        if tracked.signature is None and not tracked.unknown and start < tracked.prompt_len <= end:
            blocks = tracked.block_ids[: -(-tracked.prompt_len // self.block_size)]
            if self._foreign.isdisjoint(blocks):
                plan.snapshots[req_id] = blocks
            else:
                tracked.unknown = True
                self.unknown_signatures += 1

    def _plan_blocks(
        self, plan: StepPlan, req_id: str, tracked: _Tracked, start: int, end: int
    ) -> None:
        """Ask for the rows of the blocks that become full in this step, by their hashes."""
        tracked_hashes = self._hashes.get(req_id)
        if tracked_hashes is None:
            return
        hashes, first_whole = tracked_hashes
        first = max(start // self.block_size, first_whole)
        if tracked.remote:
            # The prompt's KV came from elsewhere: the table holds only blocks wholly past it.
            first = max(first, -(-tracked.prompt_len // self.block_size))
        # A block whose hash vLLM has not computed yet (its last token not yet appended, as
        # under async scheduling) is left out rather than guessed.
        last = min(end // self.block_size, len(hashes), len(tracked.block_ids))
        for i in range(first, last):
            if tracked.block_ids[i] in self._foreign:
                self.unknown_blocks += 1  # its row is not its tokens' counts
                continue
            plan.block_snapshots[external_hash(hashes[i])] = tracked.block_ids[i]

    def _slot(self, tracked: _Tracked, position: int) -> int:
        block = tracked.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def apply(self, report: StepReport | None) -> None:
        if report is not None:
            if report.moe_layers:
                self.moe_layers = report.moe_layers
            for req_id, counts in report.signatures.items():
                self.shape = counts.shape
                tracked = self._requests.get(req_id) or self._awaiting.get(req_id)
                if tracked is not None:
                    tracked.signature = counts
                    if tracked.prompt_len and len(wire.empty_layers(counts)):
                        self.zero_signatures += 1
            if self.publish_blocks:
                self.stored_blocks.update(report.block_counts)
            for req_id, counts in report.decode_counts.items():
                self.shape = counts.shape  # a decode-only engine computes no signature
                tracked = (self._requests.get(req_id) or self._awaiting.get(req_id)
                           or self._recording.get(req_id))
                if tracked is not None:
                    prev = tracked.decode_counts
                    tracked.decode_counts = counts if prev is None else prev + counts
        for tracked in self._awaiting.values():
            self._fill(tracked)
        self._awaiting.clear()
        for tracked in self._recording.values():
            counts = tracked.decode_counts
            if counts is None and self.shape is not None:
                counts = np.zeros(self.shape, dtype=np.int32)  # finished before a decode step
            if counts is not None and tracked.record_as is not None:
                self.recorded.append(
                    (tracked.record_as, tracked.prompt_len, tracked.output_tokens, counts))
        self._recording.clear()

    def finished(self, req_id: str, output_tokens: int = 0) -> dict[str, Any]:
        """The ``kv_transfer_params`` to return for a finishing request (filled now or soon)."""
        tracked = self._requests.pop(req_id, None)
        self._hashes.pop(req_id, None)
        self._admitted.pop(req_id, None)
        self._record.pop(req_id, None)  # finished (aborted) before it was ever scheduled
        params: dict[str, Any] = {}
        if tracked is not None and tracked.record_as is not None:
            # Its last step's counts arrive with this step's report, applied next.
            tracked.output_tokens = output_tokens
            self._recording[req_id] = tracked
        if tracked is None or tracked.remote:
            return params
        tracked.pending_params = params
        self._fill(tracked)
        self._awaiting[req_id] = tracked
        return params

    def _fill(self, tracked: _Tracked) -> None:
        params = tracked.pending_params
        if params is None:
            return
        if tracked.signature is not None:
            params.update(wire.encode(tracked.signature, self.moe_layers))
        if self.count_decode:
            counts = tracked.decode_counts
            if counts is None and self.shape is not None:
                counts = np.zeros(self.shape, dtype=np.int32)
            if counts is not None:
                params[DECODE_COUNTS_KEY] = wire.encode(counts)[wire.SIGNATURE_KEY]
