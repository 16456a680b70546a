"""Decode-routing policies behind one interface, and the registry that names them.

``make_policy`` is the one constructor the proxy and the simulator use, so a policy name means
the same thing in both; every list of policy names elsewhere comes from ``POLICIES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stages.errors import EldrError
from stages.routing.context import RoutingContext
from stages.routing.params import build_params
from stages.routing.policies.base import DecodePolicy, PrefillRequest, RoutingRequest
from stages.routing.policies.eldr import EldrParams, EldrPolicy
from stages.routing.policies.eldr_bounded import EldrBoundedParams, EldrBoundedPolicy
from stages.routing.policies.eldr_kv import EldrKvPolicy, KvOnlyPolicy, KVParams
from stages.routing.policies.eldr_union import EldrUnionPolicy, UnionParams
from stages.routing.policies.jsq import JsqPolicy
from stages.routing.policies.p2c import PowerOfTwoPolicy
from stages.routing.policies.random_policy import RandomPolicy
from stages.routing.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[DecodePolicy]] = {
    cls.name: cls
    for cls in (
        EldrPolicy, EldrBoundedPolicy, EldrUnionPolicy, EldrKvPolicy, KvOnlyPolicy,
        RoundRobinPolicy, JsqPolicy, RandomPolicy, PowerOfTwoPolicy,
    )
}


def policy_class(name: str) -> type[DecodePolicy]:
    cls = POLICIES.get(name)
    if cls is None:
        raise EldrError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return cls


def policy_params(name: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """Policy ``name``'s options: its ``Params`` defaults with ``overrides`` applied."""
    return build_params(policy_class(name).Params, overrides or {}, name)


def make_policy(
    name: str, context: RoutingContext, params: Mapping[str, Any] | None = None
) -> DecodePolicy:
    """Build policy ``name`` for the deployment ``context`` with its options overridden by
    ``params``; an unknown name or option, a bad value, or ELDR without enough centroids is a
    user error."""
    return policy_class(name)(context, policy_params(name, params))


def needs_centroids(name: str) -> bool:
    """Whether policy ``name`` routes by centroids (and so needs a fitted artifact)."""
    cls = POLICIES.get(name)
    return cls is not None and cls.needs_centroids


def reads_signatures(name: str) -> bool:
    """Whether policy ``name`` reads the prefill's signature (as features or raw counts), so
    its workers must record them (the serve self-check); load balancers read neither."""
    cls = POLICIES.get(name)
    return cls is not None and (cls.uses_signature or cls.uses_counts)


__all__ = [
    "POLICIES",
    "DecodePolicy",
    "EldrBoundedParams",
    "EldrBoundedPolicy",
    "EldrKvPolicy",
    "EldrParams",
    "EldrPolicy",
    "EldrUnionPolicy",
    "KVParams",
    "PrefillRequest",
    "RoutingRequest",
    "UnionParams",
    "make_policy",
    "needs_centroids",
    "policy_class",
    "policy_params",
    "reads_signatures",
]
