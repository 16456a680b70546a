"""Proxies in front of the same workers, kept in step: admin changes reach every one, and
``/metrics`` on any of them shows all of them.

Each peer is one proxy process, named by a base URL that reaches exactly it (``--proxy-workers``
gives each process a private loopback address; ``--peer`` names proxies elsewhere). A change
made on one proxy is applied there first, so a refused change is refused before any peer hears
of it, then sent on to each peer once: requests from a peer carry ``PEER_HEADER`` and are not
sent on again. What a peer answered is part of the admin response, so an operator sees at once
a peer that was not reached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.requests import Request

from stages.serve.proxy.client.upstream import UPSTREAM_ERRORS, fetch, leg_limits
from stages.serve.proxy.state import ProxyState

PEER_HEADER = "X-Eldr-Peer"
# On a /metrics answer to a peer: the answering proxy's name (its ``proxy_id``).
PROXY_HEADER = "X-Eldr-Proxy"
# The label that tells the proxies' series apart in the merged /metrics.
PROXY_LABEL = "proxy"
# A peer's whole answer, as each wait within it.
_PEER_TIMEOUT_S = 10.0
_PEER_LIMITS = leg_limits(_PEER_TIMEOUT_S, _PEER_TIMEOUT_S)


def from_peer(request: Request) -> bool:
    return PEER_HEADER.lower() in request.headers


async def tell_peers(
    state: ProxyState, request: Request, body: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    """Send the admin request ``request`` (its method and path, with ``body``: what this proxy
    applied) to every peer; what each answered. Nothing is sent on for a request that came
    from a peer."""
    if from_peer(request):
        return []
    headers = {PEER_HEADER: state.config.proxy_id, "Content-Type": "application/json"}
    auth = request.headers.get("authorization")
    if auth is not None:  # the peers share this proxy's admin key
        headers["Authorization"] = auth
    data = orjson.dumps(body) if body is not None else b""
    answers = []
    for url in state.config.peers:
        answer: dict[str, Any] = {"peer": url}
        try:
            async with asyncio.timeout(_PEER_TIMEOUT_S):
                reply = await fetch(state.control_client, request.method, url,
                                    request.url.path, _PEER_LIMITS, headers, data)
            answer["status"] = reply.status
            if reply.status >= 400:
                answer["error"] = reply.content[:500].decode(errors="replace")
        except UPSTREAM_ERRORS as exc:
            answer["error"] = repr(exc)
        answers.append(answer)
    return answers


def metrics_headers(state: ProxyState) -> dict[str, str]:
    return {PROXY_HEADER: state.config.proxy_id}


async def metrics_of_all(state: ProxyState, request: Request) -> bytes:
    """This proxy's metrics, with its peers' merged in (each series labelled with its proxy);
    only its own for a peer asking, or when it has none."""
    own = state.metrics.render()
    if not state.config.peers or from_peer(request):
        return own
    texts = {state.config.proxy_id: own}
    headers = {PEER_HEADER: state.config.proxy_id}
    for url in state.config.peers:
        try:
            async with asyncio.timeout(_PEER_TIMEOUT_S):
                reply = await fetch(state.control_client, "GET", url, "/metrics", _PEER_LIMITS,
                                    headers)
            if reply.status == 200:
                texts[reply.headers.get(PROXY_HEADER, url)] = reply.content
        except UPSTREAM_ERRORS:
            # A peer that is restarting or gone: its series are missing from this scrape, as
            # Prometheus shows any target it could not reach, and the rest are still served.
            continue
    return merge_metrics(texts)


def merge_metrics(texts: Mapping[str, bytes]) -> bytes:
    """Prometheus text expositions of several proxies as one, each series labelled with
    ``proxy`` (the mapping's key): a family appears once, its series from every proxy."""
    merged: dict[str, Metric] = {}
    for proxy, text in texts.items():
        for family in text_string_to_metric_families(text.decode()):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            into.samples.extend(
                s._replace(labels={**s.labels, PROXY_LABEL: proxy}) for s in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families
