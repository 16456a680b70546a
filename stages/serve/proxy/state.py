"""Everything one proxy instance owns, held by its app (``app.state.proxy``), never global."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from stages.errors import EldrError
from stages.routing.kv.block_experts import BlockExperts, ExpertEventsView
from stages.routing.policies import needs_centroids
from stages.routing.prefill_router import PrefillRouter
from stages.serve.proxy.client.http1 import Http1Client, Timeouts
from stages.serve.proxy.client.upstream import leg_limits
from stages.serve.proxy.config import ProxyConfig
from stages.serve.proxy.ops.metrics import ProxyMetrics
from stages.serve.proxy.ops.rejoin import RestartCounts, SelfChecks, no_restarts
from stages.serve.proxy.recording.recorder import TrafficRecorder
from stages.serve.proxy.router.artifact_source import ArtifactLoader, load_from_store
from stages.serve.proxy.router.decode_router import DecodeRouter
from stages.serve.proxy.router.online_refit import FitFn, OnlineRefitter, balanced_fit
from stages.serve.proxy.view.kv_routing import KVRouting
from stages.serve.proxy.view.published_batches import PublishedBatches
from stages.serve.proxy.view.workers import WorkerPool

log = logging.getLogger(__name__)


@dataclass
class ProxyState:
    config: ProxyConfig
    prefill: WorkerPool
    decode: WorkerPool
    prefill_router: PrefillRouter
    router: DecodeRouter
    metrics: ProxyMetrics
    artifact_loader: ArtifactLoader
    restarts: RestartCounts = no_restarts
    # Self-checks of workers (re)joining rotation; None when the proxy does not know the model.
    checks: SelfChecks | None = None
    recorder: TrafficRecorder | None = None  # `eldr serve --record`
    kv: KVRouting | None = None  # the workers' KV caches, when they publish KV events
    # What the tokens of every block any worker holds routed to, when they publish expert
    # events (prefill workers first, as KVConfig.expert_events).
    block_experts: ExpertEventsView | None = None
    # Built once from the config: the per-request path only passes them along. The legs'
    # limits are for ``leg_client``; the others for ``control_client``.
    prefill_limits: Timeouts = field(init=False, repr=False)
    decode_limits: Timeouts = field(init=False, repr=False)
    prefill_timeout: Timeouts = field(init=False, repr=False)  # /v1/models
    health_timeout: Timeouts = field(init=False, repr=False)
    # The clients exist while the app runs (its lifespan opens and closes them): the legs'
    # (upstream.open_leg_client) and every other call's (upstream.open_control_client).
    leg_client: Http1Client = field(init=False, repr=False)
    control_client: Http1Client = field(init=False, repr=False)
    # Set once the proxy is stopping: new requests and /health answer 503 while the requests
    # in flight finish (stages.serve.proxy.app.DrainingServer).
    draining: bool = False
    # Requests let in that hold no worker lease yet (admission.Admission).
    admitting: int = 0

    @property
    def kv_active(self) -> bool:
        """Whether the active policy routes by KV (tokenizing a prompt costs otherwise)."""
        return self.kv is not None and self.router.policy.reads_kv

    def in_flight(self) -> int:
        """This proxy's requests on a worker now, prefilling or decoding."""
        return int(self.decode.own_loads().sum() + self.prefill.own_loads().sum())

    def cluster_load(self) -> int:
        """Requests on a worker now: this proxy's, and the other proxies' that the decode
        workers publish (admission bounds the cluster's queue, not one proxy's share), plus
        this proxy's requests let in that hold no lease yet (admission.Admission)."""
        return int(self.decode.loads().sum() + self.prefill.own_loads().sum()) + self.admitting

    def __post_init__(self) -> None:
        c = self.config
        self.prefill_limits = leg_limits(c.prefill_timeout_s, c.connect_timeout_s)
        self.decode_limits = leg_limits(c.decode_timeout_s, c.connect_timeout_s)
        self.prefill_timeout = leg_limits(c.prefill_timeout_s, c.connect_timeout_s)
        self.health_timeout = leg_limits(c.health_timeout_s, c.health_timeout_s)


def build_state(
    config: ProxyConfig,
    artifact_loader: ArtifactLoader = load_from_store,
    refit_fn: FitFn = balanced_fit,
    restarts: RestartCounts = no_restarts,
) -> ProxyState:
    """Load the artifact (if configured) and wire the parts; errors surface before serving."""
    artifact = None
    if config.artifact_store is not None:
        artifact = artifact_loader(config.artifact_store, config.artifact_version)
    elif needs_centroids(config.policy):
        raise EldrError(
            f"policy {config.policy!r} needs an artifact: set artifact_store (eldr fit writes one)"
        )
    num_decode = len(config.decode_urls)
    # More clusters than workers is fine (cluster_map spreads them); fewer leaves a worker idle.
    mismatched = artifact is not None and len(artifact.centroids) < num_decode
    if mismatched and not needs_centroids(config.policy):
        # A load-only policy does not need the artifact; an unrelated fit lying in the store
        # must not stop the proxy. Switching to eldr later says why it cannot.
        log.warning(
            "artifact %s has %d centroids for %d decode workers; serving without it",
            artifact.version,
            len(artifact.centroids),
            num_decode,
        )
        artifact = None
    refitter = None
    if config.online_refit:
        if artifact is None:
            raise EldrError("online refit needs an artifact to start from")
        refitter = OnlineRefitter(
            len(artifact.centroids),
            window_s=config.refit_window_s,
            interval_s=config.refit_interval_s,
            seed=config.seed,
            fit_fn=refit_fn,
        )
    published = None
    if config.decode_batch_endpoints:
        published = PublishedBatches(len(config.decode_urls), config.batch_stale_after_s)
    decode = WorkerPool(config.decode_urls, "decode", config.ejection, published=published)
    prefill = WorkerPool(config.prefill_urls, "prefill", config.ejection)
    checks = None
    if config.self_check is not None:
        checks = SelfChecks(
            config.self_check, config.model,
            leg_limits(config.self_check_timeout_s, config.connect_timeout_s),
            (prefill, decode), restarts, verified_at_start=config.checked_at_start,
        )
    recorder = None
    if config.record is not None:
        from stages.vllm_compat import installed_vllm

        recorder = TrafficRecorder(config.record, config.self_check, config.model or "unknown",
                                   installed_vllm(), seed=config.seed)
    router = DecodeRouter(
        len(decode), config.policy, artifact, seed=config.seed, refitter=refitter,
        worker_slots=config.decode_slots, policy_config=config.policy_config,
        model_top_k=config.model_top_k,
    )
    if published is not None:
        published.listener = router  # the others' requests weighed by their experts too
    kv = KVRouting(config.kv) if config.kv is not None else None
    return ProxyState(
        config=config,
        prefill=prefill,
        decode=decode,
        prefill_router=PrefillRouter(config.prefill_urls),
        router=router,
        metrics=ProxyMetrics(decode, prefill, restarts, checks, kv),
        artifact_loader=artifact_loader,
        restarts=restarts,
        checks=checks,
        recorder=recorder,
        kv=kv,
        block_experts=(ExpertEventsView(len(config.kv.expert_events), BlockExperts())
                       if config.kv is not None and config.kv.expert_events else None),
    )
