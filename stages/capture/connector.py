"""``EldrSignatureConnector``: vLLM KV connector that records expert signatures.

It moves no KV itself. For PD it runs beside vLLM's NixlConnector inside vLLM's own
``MultiConnector`` (composition, no copy: see ``stages.engine.kv_transfer_config``), listed
first so the ``kv_transfer_params`` dict of a finished prefill is the one this connector
returns and later fills with the signature. Alone, it serves ``eldr capture`` (signature and
per-request decode counts, ``count_decode`` in its extra config).

Paths across vLLM's processes:
- worker process: every MoE router writes its top-k ids into a static buffer
  (:mod:`stages.capture.topk_sink`, attached while vLLM builds the model) and
  :class:`SignatureRecorder` adds them into the block-indexed table after each forward;
- engine-core (scheduler) process: :class:`SignatureLedger` plans each step (the plan rides in
  the connector metadata vLLM sends to workers) and files the worker's report (it rides back
  in ``kv_connector_worker_meta``); it returns the signature in ``kv_transfer_params``;
- API-server process: decode-step statistics arrive as connector stats and are exported as
  Prometheus metrics by :class:`EldrPromMetrics`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

from stages.capture.batch_publisher import (
    RECORD_KEY,
    BatchPublisher,
    request_name,
)
from stages.capture.expert_events import PUBLISH_EXPERTS_KEY, ExpertEventPublisher
from stages.capture.kv_group import signature_group
from stages.capture.ledger import SignatureLedger
from stages.capture.messages import StepPlan, StepReport
from stages.capture.parallel import ParallelLayout, check_layout
from stages.capture.recorder import SignatureRecorder
from stages.capture.stats import EldrConnectorStats, EldrPromMetrics
from stages.signature import wire

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# kv_connector_extra_config key: the ZMQ endpoint a decode worker publishes its batch on.
PUBLISH_BATCH_KEY = "publish_batch"


def restore_compute_affinity() -> None:
    """Undo NixlConnector's re-pinning of the worker's main thread on CPU.

    On CPU, vLLM's NixlConnector pins the thread that creates it to the last core of each NUMA
    node "for KV transfer"; that thread is also OpenMP thread 0, which runs the model, so every
    PD worker ends up computing on the same core. When vLLM was given explicit cores, put the
    main thread back on the first of them, where vLLM's own binding had placed it.
    """
    import os

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind in ("auto", "nobind", "all") or "|" in bind or not hasattr(os, "sched_setaffinity"):
        return
    from stages.engine import parse_cores

    try:
        cores = parse_cores(bind)
    except ValueError:  # not an explicit core list: vLLM did not pin, nothing to restore
        return
    os.sched_setaffinity(0, {cores[0]})


class EldrSignatureConnector(KVConnectorBase_V1, SupportsHMA):
    # SupportsHMA: without it vLLM turns its hybrid KV cache manager off for the whole engine,
    # which slows sliding-window models (GPT-OSS, Gemma) and stops hybrid SSM models starting.
    # Signatures follow one full-attention group (stages.capture.kv_group).

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        from stages.engine import on_cpu
        from stages.vllm_compat import check_vllm

        # Only engines that record are checked: eldr's plugin is loaded by every vLLM engine
        # in the environment, and must never stop one that does not use this connector.
        check_vllm()
        check_layout(ParallelLayout.of_engine(vllm_config.parallel_config, on_cpu(),
                                              vllm_config.speculative_config))
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._count_decode = bool(extra.get("count_decode", False))
        group = signature_group(kv_cache_config)
        self._recorder: SignatureRecorder | None = None
        self._ledger: SignatureLedger | None = None
        self._pending_report: StepReport | None = None
        self._stats = EldrConnectorStats()
        self._reported_failure = False  # logged once per engine, counted every time
        self._reported_unknown = False
        self._reported_hash_size = False
        self._publisher: BatchPublisher | None = None
        self._expert_publisher: ExpertEventPublisher | None = None
        if role == KVConnectorRole.SCHEDULER:
            experts_endpoint = extra.get(PUBLISH_EXPERTS_KEY)
            self._ledger = SignatureLedger(group.block_size, None, self._count_decode,
                                           group=group.index,
                                           publish_blocks=bool(experts_endpoint))
            if experts_endpoint:  # proxies follow each stored block's expert counts
                self._expert_publisher = ExpertEventPublisher(str(experts_endpoint))
            endpoint = extra.get(PUBLISH_BATCH_KEY)
            if endpoint:  # a decode worker of eldr serve: the proxies subscribe to its batch
                self._publisher = BatchPublisher(str(endpoint))
        else:
            self._recorder = SignatureRecorder(
                kv_cache_config.num_blocks, group.block_size,
                vllm_config.scheduler_config.max_num_batched_tokens,
                slot_layer=group.layer_name,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._recorder is not None
        device = next(iter(kv_caches.values())).device if kv_caches else torch.device("cpu")
        context = self._vllm_config.compilation_config.static_forward_context
        restore_compute_affinity()
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != 0:
            # Tensor-parallel ranks route every token alike: the stage's first rank records,
            # the others keep their hooks (same graph on every rank) and report nothing.
            self._recorder = None
            return
        bound = self._recorder.bind(context, device)  # raises if a layer lacks its buffer
        if bound == 0:
            logger.warning("eldr: no MoE router found; this model yields no signatures")
        else:
            logger.info(
                "eldr: recording expert signatures for %d MoE layers x %d experts",
                bound, self._recorder.num_experts,
            )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._recorder is not None and isinstance(connector_metadata, StepPlan):
            self._recorder.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._recorder is None:
            return None
        return self._recorder.end_step()

    # -- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # The scheduler's first look at a request (again each time it could not place it).
        if self._publisher is not None:
            params = request.kv_transfer_params
            name = request_name(request.request_id, params)
            self._publisher.add(request.request_id, name, wire.entries(params))
            if params and params.get(RECORD_KEY) is True and self._ledger is not None:
                self._ledger.mark_record(request.request_id, name)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._ledger is None:
            return
        # Inside vLLM's MultiConnector this connector is told no external tokens even when
        # NixlConnector loads the prompt: its request parameters say so (this connector is
        # listed first, so it reads them before NixlConnector clears do_remote_prefill).
        params = request.kv_transfer_params or {}
        remote = num_external_tokens > 0 or bool(params.get("do_remote_prefill"))
        # The blocks that are no prefix-cache hit: any of them a connector fills holds KV this
        # engine did not compute, whose row in the worker's table is not its counts.
        new_blocks = blocks.get_unhashed_block_ids_all_groups()[self._ledger.group]
        self._ledger.admitted(request.request_id, new_blocks, remote)
        if self._expert_publisher is not None:
            self._track_hashes(request, remote)

    def _track_hashes(self, request: Request, remote: bool) -> None:
        assert self._ledger is not None
        block_size = self._ledger.block_size
        if len(request.block_hashes) != request.num_tokens // block_size:
            # vLLM hashes no blocks (prefix caching off) or blocks of another size than the
            # signature group's (a hybrid model): a hash would not name a signature row.
            if not self._reported_hash_size:
                self._reported_hash_size = True
                logger.error(
                    "eldr: expert events are off: vLLM hashes %d blocks for %d tokens, not"
                    " blocks of %d (prefix caching off, or a hybrid model's KV groups)",
                    len(request.block_hashes), request.num_tokens, block_size)
            return
        self._ledger.track_hashes(request.request_id, request.block_hashes,
                                  request.num_prompt_tokens if remote else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._ledger is not None
        return self._ledger.plan(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._ledger is not None
        report = connector_output.kv_connector_worker_meta
        report = report.resolve() if isinstance(report, StepReport) else None
        zero_before = self._ledger.zero_signatures
        self._ledger.apply(report)
        if self._ledger.recorded:
            if self._publisher is not None:
                for recorded in self._ledger.recorded:
                    self._publisher.finished(*recorded)
            self._ledger.recorded.clear()
        if self._ledger.stored_blocks:
            if self._expert_publisher is not None:
                self._expert_publisher.publish(self._ledger.stored_blocks)
            self._ledger.stored_blocks = {}
        if report is not None and report.decode_steps:
            self._stats.add(report)
        zero = self._ledger.zero_signatures - zero_before
        self._count_unknown()
        unrecorded = report.unrecorded_steps if report is not None else 0
        if zero or unrecorded:
            self._stats.add_failures(zero, unrecorded)
            if not self._reported_failure:
                self._reported_failure = True
                logger.error(
                    "eldr: expert ids were not recorded (%d empty signatures, %d steps without"
                    " ids): the MoE routers' recording hook is not in the model this engine"
                    " runs. Requests are routed without a signature; counted in"
                    " eldr_zero_signatures_total and eldr_unrecorded_steps_total.",
                    zero, unrecorded,
                )

    def _count_unknown(self) -> None:
        """Signatures and expert events left out because they would read rows of blocks whose
        KV another engine computed (stages.capture.ledger): expected on a decode worker that
        prefills some requests itself, so counted and told once, not an error."""
        assert self._ledger is not None
        signatures, blocks = self._ledger.unknown_signatures, self._ledger.unknown_blocks
        if not signatures and not blocks:
            return
        self._ledger.unknown_signatures = self._ledger.unknown_blocks = 0
        self._stats.add_unknown(signatures, blocks)
        if not self._reported_unknown:
            self._reported_unknown = True
            logger.info(
                "eldr: %d prompt signatures and %d expert events are unknown here: they would"
                " read KV blocks another engine computed (loaded through the KV connector),"
                " whose expert ids this engine never saw. They are left out; counted in"
                " eldr_unknown_signatures_total and eldr_unknown_block_events_total.",
                signatures, blocks,
            )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._ledger is not None
        if self._publisher is not None:
            self._publisher.remove(request.request_id)
        return False, self._ledger.finished(request.request_id, request.num_output_tokens)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # The ledger tracked the request's blocks itself; which ones it holds now is not needed.
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def shutdown(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
        if self._expert_publisher is not None:
            self._expert_publisher.close()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, EldrConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return EldrConnectorStats(data=data) if data is not None else EldrConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return EldrPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
