"""Decode-routing policies behind one interface, and the registry that names them.

``make_policy`` is the one constructor the proxy and the simulator use, so a policy name means
the same thing in both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from stages.errors import EldrError
from stages.routing.policies.base import DecodePolicy, RoutingRequest, signature_counts
from stages.routing.policies.eldr import DEFAULT_TAU, EldrPolicy
from stages.routing.policies.eldr_bounded import DEFAULT_EPSILON, EldrBoundedPolicy
from stages.routing.policies.eldr_union import EldrUnionPolicy, UnionParams
from stages.routing.policies.jsq import JsqPolicy
from stages.routing.policies.p2c import PowerOfTwoPolicy
from stages.routing.policies.random_policy import RandomPolicy
from stages.routing.policies.round_robin import RoundRobinPolicy

if TYPE_CHECKING:
    from stages.routing.cost_model import CostModel

POLICIES: dict[str, type[DecodePolicy]] = {
    cls.name: cls
    for cls in (
        EldrPolicy, EldrBoundedPolicy, EldrUnionPolicy, RoundRobinPolicy, JsqPolicy,
        RandomPolicy, PowerOfTwoPolicy,
    )
}


def make_policy(
    name: str,
    num_workers: int,
    seed: int = 0,
    centroids: np.ndarray | None = None,
    tau: float = DEFAULT_TAU,
    worker_of_centroid: np.ndarray | None = None,
    worker_slots: int | None = None,
    epsilon: float = DEFAULT_EPSILON,
    top_k: int | None = None,
    cost: CostModel | None = None,
) -> DecodePolicy:
    """Build policy ``name`` for ``num_workers`` decode workers.

    ``centroids`` (``[K, D]``, K >= num_workers: see ``cluster_map``) and ``tau`` only matter
    to signature-aware policies, ``worker_slots`` (each worker's batch size) and ``epsilon``
    (load slack) to load-capped ones, ``top_k`` (the model's experts per token) and ``cost``
    (decode step-time model) to the batch-aware one; an unknown name or ELDR without enough
    centroids is a user error.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise EldrError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    if num_workers < 1:
        raise EldrError(f"need at least one decode worker, got {num_workers}")
    if issubclass(cls, EldrPolicy):
        if centroids is None:
            raise EldrError(f"policy {name!r} needs centroids: load an artifact (eldr fit) first")
        kwargs: dict[str, object] = {}
        if issubclass(cls, EldrBoundedPolicy):
            kwargs |= {"worker_slots": worker_slots, "epsilon": epsilon}
        return cls(
            num_workers, seed, centroids=centroids, tau=tau, worker_of_centroid=worker_of_centroid,
            **kwargs,
        )
    if issubclass(cls, EldrUnionPolicy):
        params = UnionParams(top_k=top_k, cost=cost, worker_slots=worker_slots)
        return cls(num_workers, seed, params=params)
    return cls(num_workers, seed)


def needs_centroids(name: str) -> bool:
    """Whether policy ``name`` routes by centroids (and so needs a fitted artifact)."""
    cls = POLICIES.get(name)
    return cls is not None and issubclass(cls, EldrPolicy)


__all__ = [
    "POLICIES", "DecodePolicy", "EldrBoundedPolicy", "EldrPolicy", "EldrUnionPolicy",
    "RoutingRequest", "UnionParams", "make_policy", "needs_centroids", "signature_counts",
]
