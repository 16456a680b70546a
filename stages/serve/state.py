"""Everything one proxy instance owns, held by its app (``app.state.proxy``), never global."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import httpx

from stages.errors import EldrError
from stages.serve.artifact_source import ArtifactLoader, load_from_store
from stages.serve.config import ProxyConfig
from stages.serve.decode_router import DecodeRouter
from stages.serve.metrics import ProxyMetrics
from stages.serve.online_refit import FitFn, OnlineRefitter, balanced_fit
from stages.serve.prefill_router import PrefillRouter
from stages.serve.workers import WorkerPool

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
    _client: httpx.AsyncClient | None = field(default=None, repr=False)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the proxy's HTTP client exists only while the app is running")
        return self._client

    def decode_timeout(self) -> httpx.Timeout:
        c = self.config
        return httpx.Timeout(c.decode_timeout_s, connect=c.connect_timeout_s)

    def prefill_timeout(self) -> httpx.Timeout:
        c = self.config
        return httpx.Timeout(c.prefill_timeout_s, connect=c.connect_timeout_s)


def build_state(
    config: ProxyConfig,
    artifact_loader: ArtifactLoader = load_from_store,
    refit_fn: FitFn = balanced_fit,
) -> ProxyState:
    """Load the artifact (if configured) and wire the parts; errors surface before serving."""
    artifact = None
    if config.artifact_store is not None:
        artifact = artifact_loader(config.artifact_store, config.artifact_version)
    elif config.policy == "eldr":
        raise EldrError("policy 'eldr' needs an artifact: set artifact_store (eldr fit writes one)")
    num_decode = len(config.decode_urls)
    if artifact is not None and config.policy != "eldr" and len(artifact.centroids) != num_decode:
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
            num_decode,
            window_s=config.refit_window_s,
            interval_s=config.refit_interval_s,
            seed=config.seed,
            fit_fn=refit_fn,
        )
    decode = WorkerPool(config.decode_urls, "decode")
    prefill = WorkerPool(config.prefill_urls, "prefill")
    router = DecodeRouter(
        len(decode), config.policy, config.tau, artifact, seed=config.seed, refitter=refitter
    )
    return ProxyState(
        config=config,
        prefill=prefill,
        decode=decode,
        prefill_router=PrefillRouter(config.prefill_urls),
        router=router,
        metrics=ProxyMetrics(decode, prefill),
        artifact_loader=artifact_loader,
    )
