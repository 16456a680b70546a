"""The decode-routing brain of the proxy: policy + artifact + optional online refit.

Synchronous and HTTP-free: the proxy calls it on the event loop between awaits, so a decision
never interleaves with another, and tests drive it directly.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from stages.errors import EldrError
from stages.fit.artifact import check_cluster_count
from stages.routing.arrival_signature import arrival_signature
from stages.routing.context import RoutingContext
from stages.routing.inputs import routing_inputs, signature_counts
from stages.routing.kv.block_experts import BlockExperts
from stages.routing.policies import (
    DecodePolicy,
    PrefillRequest,
    RoutingRequest,
    make_policy,
)
from stages.routing.policies.cluster_map import remap_for_healthy, spread_clusters
from stages.routing.policy_config import PolicyConfig
from stages.serve.proxy.router.artifact_source import ArtifactLike
from stages.serve.proxy.router.online_refit import OnlineRefitter, RefitResult
from stages.signature import wire

# What a peer's request hands a policy's ``on_dispatch``: it was not routed here, so no loads.
_NO_LOADS = np.zeros(0, dtype=np.int64)
_NO_WORKERS = np.zeros(0, dtype=bool)


class Features(NamedTuple):  # a tuple: one per request, built in half a dataclass's time
    vector: np.ndarray | None  # float32 [D] unit vector, None when unknown
    missing: bool  # the policy wanted a signature and the prefill did not deliver a valid one
    counts: np.ndarray | None = None  # int16 [L, E] as decoded, for policies that read counts


NO_FEATURES = Features(None, missing=False)


class KVInputs(NamedTuple):
    """What KV-aware policies read of a request (``RoutingRequest``'s fields of that name)."""

    prompt_tokens: int = 0
    cached_tokens: np.ndarray | None = None
    output_tokens: int = 0


NO_KV = KVInputs()


class Decision(NamedTuple):
    """A chosen worker and what to call (with the worker index) once its request ended: the
    policy then drops exactly this request's part (``WorkerPool.acquire``'s release hook)."""

    worker: int
    on_complete: Callable[[int], None]
    # What the workers held of the prompt when it was chosen: a decision made at arrival
    # carries it to the decode leg, which counts it without matching the prompt again.
    kv: KVInputs = NO_KV
    # A decision made at arrival, on the signature at arrival: call it with the prefill's
    # signature once that is there, and the policy counts the request with it
    # (``DecodePolicy.on_signature``).
    on_signature: Callable[[Features], None] | None = None


@dataclass(frozen=True)
class RefitJob:
    samples: np.ndarray
    current: np.ndarray  # the centroids in place when the job was made
    generation: int


class DecodeRouter:
    def __init__(
        self,
        num_workers: int,
        policy: str,
        artifact: ArtifactLike | None,
        seed: int = 0,
        refitter: OnlineRefitter | None = None,
        worker_slots: int | None = None,
        policy_config: PolicyConfig | None = None,
        model_top_k: int | None = None,
    ) -> None:
        self.num_workers = num_workers
        self.model_top_k = model_top_k  # the served model's, when the proxy knows the model
        # Every policy's options, not only the active one's: a switch back finds them.
        self.policy_config = policy_config or PolicyConfig()
        self.worker_slots = worker_slots
        self.seed = seed
        # The active policy's own seed (its random ties and draws): ``seed`` unless a switch
        # gave one, as the bench does per round so its rounds are independent draws.
        self.policy_seed = seed
        self.refitter = refitter
        self.artifact: ArtifactLike | None = None
        self._centroids: np.ndarray | None = None
        self._worker_of_centroid: np.ndarray | None = None
        self._expected_shape: tuple[int, int] | None = None
        # Bumped whenever centroids are replaced wholesale, so a refit computed against old
        # centroids is dropped instead of overwriting a newer artifact.
        self.generation = 0
        # Names each dispatched request for the policy until it completes.
        self._keys = itertools.count()
        # Other proxies' requests on each worker whose signatures came (``peer_joined``), as
        # the policy heard of them: replayed to a policy built later.
        self._peers: dict[tuple[int, str], RoutingRequest] = {}
        if artifact is not None:
            self._install(artifact)
        self.policy: DecodePolicy = self._build(policy, self.policy_config, seed)

    # --- configuration (admin API) ---

    def _build(self, name: str, config: PolicyConfig, seed: int) -> DecodePolicy:
        context = RoutingContext(
            self.num_workers,
            seed=seed,
            centroids=self._centroids,
            worker_of_centroid=self._worker_of_centroid,
            worker_slots=self.worker_slots,
            top_k=self._top_k(),
        )
        return make_policy(name, context, config.overrides(name))

    def _top_k(self) -> int | None:
        """The model's experts per token, which turns counts into per-token probabilities: the
        artifact's identity, else the served model's config (else counts policies route by
        load, e.g. attached workers of an unknown model)."""
        if self.artifact is not None:
            return int(self.artifact.identity.top_k)
        return self.model_top_k

    def set_policy(
        self, name: str, overrides: Mapping[str, Any] | None = None, seed: int | None = None
    ) -> None:
        """Switch to policy ``name``, its options updated by ``overrides`` (kept for later
        switches back to it), drawing from ``seed`` (None: the router's own)."""
        config = self.policy_config
        if overrides is not None:
            config = config.updated(name, overrides)
        seed = self.seed if seed is None else seed
        self._use(self._build(name, config, seed))  # raises before anything changes
        self.policy_config = config
        self.policy_seed = seed

    def _use(self, policy: DecodePolicy) -> None:
        """Make ``policy`` the active one, told of the other proxies' requests in flight."""
        for (worker, name), request in self._peers.items():
            policy.on_dispatch(worker, request, ("peer", name))
        self.policy = policy

    def set_artifact(self, artifact: ArtifactLike) -> None:
        top_k = self._top_k()
        self._install(artifact)
        if self.policy.needs_centroids:
            self.policy.set_centroids(self._centroids, self._worker_of_centroid)
        elif self.policy.uses_counts and self._top_k() != top_k:
            # A new top-k is a new reading of every count; in-flight requests keep completing
            # on the policy that counted them (their Decision holds it).
            self._use(self._build(self.policy.name, self.policy_config, self.policy_seed))

    def _install(self, artifact: ArtifactLike) -> None:
        centroids = np.asarray(artifact.centroids, dtype=np.float32)
        if centroids.ndim != 2:
            raise EldrError(
                f"artifact {artifact.version} has centroids of shape {centroids.shape}"
            )
        check_cluster_count(centroids.shape[0], self.num_workers)
        ident = artifact.identity
        mapping = spread_clusters(centroids, self.num_workers, self.seed)
        self.artifact = artifact
        self._centroids = centroids
        self._worker_of_centroid = mapping
        self._expected_shape = (int(ident.num_layers), int(ident.num_experts))
        self.generation += 1
        if self.refitter is not None:
            self.refitter.clear()  # old vectors live in the old artifact's feature space

    @property
    def policy_name(self) -> str:
        return self.policy.name

    def clusters_of_worker(self, healthy: np.ndarray) -> list[list[int]]:
        """The centroids each worker serves while ``healthy`` workers are up."""
        if self._worker_of_centroid is None or self._centroids is None:
            return [[] for _ in range(self.num_workers)]
        mapping = remap_for_healthy(self._centroids, self._worker_of_centroid, healthy)
        return [np.flatnonzero(mapping == w).tolist() for w in range(self.num_workers)]

    # --- per request ---

    def features(self, kv_transfer_params: dict[str, Any] | None) -> Features:
        policy = self.policy
        wants_vector = policy.uses_signature and self.artifact is not None
        if not (wants_vector or policy.uses_counts):
            return NO_FEATURES
        # Without an artifact the shape is not known here; a counts policy checks it.
        features = self._features_of(wire.decode(kv_transfer_params, self._expected_shape),
                                     wants_vector)
        if features.vector is not None and self.refitter is not None:
            self.refitter.observe(features.vector, time.monotonic())
        return features

    def _features_of(self, counts: np.ndarray | None, wants_vector: bool) -> Features:
        """A signature's routing inputs, as the active policy reads them; missing where there
        is none (the worker counts empty signatures too)."""
        inputs = routing_inputs(counts, self.artifact.transform.apply if wants_vector else None)
        if inputs.counts is None:
            return Features(None, missing=True)
        return Features(inputs.features, missing=False,
                        counts=inputs.counts if self.policy.uses_counts else None)

    def arrival_features(self, ids: Sequence[int], hashes: Sequence[int], block_size: int,
                         experts: BlockExperts | None) -> Features:
        """``features`` of the prompt's signature at arrival (``routing.arrival_signature``:
        its cached blocks' counts as the expert events told them, the artifact's token
        predictor for the rest) instead of the prefill's."""
        policy = self.policy
        wants_vector = policy.uses_signature and self.artifact is not None
        if not (wants_vector or policy.uses_counts) or not ids:
            return NO_FEATURES
        predictor = self.artifact.token_predictor if self.artifact is not None else None
        if experts is None and predictor is None:
            return Features(None, missing=True)
        signature = arrival_signature(ids, hashes, block_size, experts or BlockExperts(),
                                      predictor)
        return self._features_of(signature.counts, wants_vector)

    def choose(self, features: Features, loads: np.ndarray, eligible: np.ndarray,
               kv: KVInputs = NO_KV) -> Decision:
        """Pick a worker; the caller dispatches right away, so the policy hears of it now."""
        request = RoutingRequest(
            loads=loads, eligible=eligible, features=features.vector, counts=features.counts,
            prompt_tokens=kv.prompt_tokens, cached_tokens=kv.cached_tokens,
            output_tokens=kv.output_tokens,
        )
        policy = self.policy
        worker = policy.choose(request)
        key = next(self._keys)
        policy.on_dispatch(worker, request, key)
        # Bound to the policy that heard the dispatch: after a switch the old one hears the
        # completion and forgets the request; the new one never counted it.
        return Decision(worker, partial(policy.on_complete, key=key), kv,
                        partial(self._signed, policy, worker, key))

    def _signed(self, policy: DecodePolicy, worker: int, key: int, features: Features) -> None:
        """The prefill's signature of a request ``policy`` dispatched to ``worker`` at arrival
        (bound to that policy, as its completion is)."""
        if features.vector is None and features.counts is None:
            return  # the prefill delivered none: the estimate stays
        policy.on_signature(worker, RoutingRequest(
            loads=np.zeros(self.num_workers, np.int64), eligible=np.ones(self.num_workers, bool),
            features=features.vector, counts=features.counts), key)

    def choose_local(self, loads: np.ndarray, eligible: np.ndarray, kv: KVInputs,
                     prefill: PrefillRequest) -> Decision | None:
        """At arrival: the decode worker that prefills the request itself, or None for the PD
        path (``DecodePolicy.choose_local``); a worker chosen is dispatched to right away."""
        request = RoutingRequest(loads=loads, eligible=eligible, prompt_tokens=kv.prompt_tokens,
                                 cached_tokens=kv.cached_tokens, output_tokens=kv.output_tokens)
        policy = self.policy
        worker = policy.choose_local(request, prefill)
        if worker is None:
            return None
        key = next(self._keys)
        policy.on_dispatch(worker, request, key)
        return Decision(worker, partial(policy.on_complete, key=key), kv)

    # --- the other proxies' requests, as the decode workers publish them ---

    def peer_joined(self, worker: int, name: str, signature: dict[str, Any]) -> None:
        """Another proxy's request ``name`` runs on ``worker``: the policy weighs its experts
        from now on, as it weighs those of the requests it routed itself."""
        counts = signature_counts(wire.decode(signature, self._expected_shape))
        if counts is None:
            return  # no usable signature: it counts as load only (``PublishedBatches``)
        request = RoutingRequest(loads=_NO_LOADS, eligible=_NO_WORKERS, counts=counts)
        self._peers[(worker, name)] = request
        self.policy.on_dispatch(worker, request, ("peer", name))

    def peer_left(self, worker: int, name: str) -> None:
        if self._peers.pop((worker, name), None) is not None:
            self.policy.on_complete(worker, ("peer", name))

    @property
    def peers_weighed(self) -> int:
        return len(self._peers)

    # --- online refit (the proxy runs ``fit`` off the event loop) ---

    def refit_job(self, now: float) -> RefitJob | None:
        if self.refitter is None or self._centroids is None or not self.refitter.due(now):
            return None
        return RefitJob(self.refitter.snapshot(now), self._centroids, self.generation)

    def run_refit(self, job: RefitJob) -> RefitResult:
        if self.refitter is None:
            raise EldrError("online refit is not enabled")
        return self.refitter.fit(job.samples, job.current)

    def defer_refit(self, now: float) -> None:
        """After a failed fit: wait a full interval before the next attempt."""
        if self.refitter is not None:
            self.refitter.defer(now)

    def apply_refit(self, job: RefitJob, result: RefitResult, now: float) -> bool:
        if self.refitter is None or job.generation != self.generation:
            return False
        assert self._worker_of_centroid is not None  # a job exists only with centroids
        self._centroids = result.centroids
        self._worker_of_centroid = self._worker_of_centroid[result.replaces]
        if self.policy.needs_centroids:
            self.policy.set_centroids(self._centroids, self._worker_of_centroid)
        self.refitter.mark_done(now)
        return True
