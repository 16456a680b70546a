"""The one interface every decode-routing policy implements (proxy and simulator alike).

A policy is built from the deployment it routes for (``RoutingContext``) and its options, an
instance of the frozen dataclass it declares as ``Params`` (``stages.routing.params``). It sees
the in-flight decode requests per worker, which workers are eligible (healthy),
the request's transformed signature (a unit vector, or ``None`` when the prefill did not
deliver one) and its raw prefill counts. It returns a worker index. Hooks default to no-ops so
simple policies stay small; they carry a key naming the request, unique among those in flight,
so a policy that keeps per-request state can drop exactly that request's part when it ends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any, ClassVar, NamedTuple

import numpy as np

from stages.routing.context import RoutingContext
from stages.routing.params import NoParams


class RoutingRequest(NamedTuple):
    """What a policy may look at for one decision (a tuple: one is made per request, and a
    frozen dataclass takes twice as long to build)."""

    loads: np.ndarray  # int64 [W]: in-flight decode requests per decode worker
    eligible: np.ndarray  # bool [W]: healthy workers; at least one is True
    features: np.ndarray | None = None  # float32 [D] unit vector, or None if unknown
    # int [L, E] prefill signature as sent, or None if missing (``stages.routing.inputs``: an
    # all-zero table is missing)
    counts: np.ndarray | None = None
    # The KV a decode worker already holds (KV-aware policies): the prompt's length in tokens
    # (0: unknown), the prompt tokens each worker holds as a cached prefix (None: unknown), and
    # the output tokens the request asks for (0: unknown).
    prompt_tokens: int = 0
    cached_tokens: np.ndarray | None = None
    output_tokens: int = 0


class PrefillRequest(NamedTuple):
    """What a policy that also routes prefill sees of the prefill workers."""

    loads: np.ndarray  # int64 [P]: requests in flight per prefill worker
    eligible: np.ndarray  # bool [P]
    prompt_tokens: int
    cached_tokens: np.ndarray  # int64 [P]: prompt tokens each holds as a cached prefix
    queued_tokens: np.ndarray  # int64 [P]: prompt tokens each has yet to compute
    # int64 [P]: the compute each shares (equal: the same cores or GPU; loads and queues are
    # then the group's); None: each has its own.
    compute_groups: np.ndarray | None = None


class DecodePolicy(ABC):
    name: ClassVar[str] = "base"
    uses_signature: ClassVar[bool] = False  # reads ``features`` (needs an artifact)
    uses_counts: ClassVar[bool] = False  # reads ``counts`` (no artifact needed)
    # Routes by fitted centroids: serving and the simulator must load an artifact first, and
    # ``set_centroids`` receives every new one (a refit, a switched artifact).
    needs_centroids: ClassVar[bool] = False
    # Reads ``prompt_tokens`` / ``cached_tokens`` and routes prefill too (``choose_prefill``).
    reads_kv: ClassVar[bool] = False
    # The policy's user options: a frozen dataclass whose every field has a default.
    Params: ClassVar[type[Any]] = NoParams

    def __init__(self, context: RoutingContext, params: Any = None) -> None:
        self.num_workers = context.num_workers
        self.rng = np.random.default_rng(context.seed)
        self.params = self.Params() if params is None else params

    @abstractmethod
    def choose(self, request: RoutingRequest) -> int:
        """Index of the decode worker for this request (must be eligible)."""

    def set_centroids(  # noqa: B027
        self, centroids: np.ndarray, worker_of_centroid: np.ndarray | None = None
    ) -> None:
        """New centroids ``[K, D]`` and the worker serving each; only policies that declare
        ``needs_centroids`` read them."""

    def on_dispatch(  # noqa: B027
        self, worker: int, request: RoutingRequest, key: Hashable
    ) -> None:
        """Called once the request was sent to ``worker``; ``key`` names it until it ends."""

    def choose_prefill(self, request: PrefillRequest) -> int | None:
        """The prefill worker for a request whose prompt's blocks are known, or None to leave
        prefill to the proxy's prefix hash (every policy but the KV-aware ones)."""
        return None

    @property
    def prefills_locally(self) -> bool:
        """Whether ``choose_local`` may answer a worker: callers skip gathering its inputs
        (every decode worker's cached tokens, every prefill worker's) when it cannot."""
        return False

    @property
    def decodes_at_arrival(self) -> bool:
        """Whether the decode worker is chosen when the request arrives, on its signature at
        arrival (``routing.arrival_signature``), not after its prefill on the prefill's."""
        return False

    def choose_local(self, request: RoutingRequest, prefill: PrefillRequest) -> int | None:
        """At a request's arrival, before any prefill: the decode worker that should prefill
        it itself (it holds nearly all of the prompt), or None to prefill on a prefill worker
        and choose the decode worker afterwards (every policy but the KV-aware ones)."""
        return None

    def on_signature(  # noqa: B027
        self, worker: int, request: RoutingRequest, key: Hashable
    ) -> None:
        """Request ``key``, dispatched to ``worker`` at arrival on its signature at arrival, got
        its prefill's signature (``request.counts``): a policy that models the batches its
        workers run counts it with that from now on."""

    def on_complete(self, worker: int, key: Hashable) -> None:  # noqa: B027
        """Called when request ``key`` on ``worker`` finished (success or failure). A key this
        policy never saw (dispatched before a policy switch) must be ignored."""

