"""Admin API: inspect routing state, switch policy (and its options) or artifact at run time.

``POST /admin/policy`` takes ``{"policy": name, "config": {option: value}}``, ``config``
optional: the options update that policy's (``eldr serve --policy-config``) and stay for later
switches back to it; a ``cost`` is a preset, a cost model object or a file under the eldr home
(``admin_cost``). ``GET /admin/state`` shows the active policy's options in full.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import asdict
from types import MappingProxyType
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from stages import paths
from stages.errors import EldrError
from stages.routing.params import ParamError
from stages.routing.policies import POLICIES
from stages.serve.proxy.config import check_unchecked_policy
from stages.serve.proxy.errors import ProxyError, json_error
from stages.serve.proxy.front.admin_cost import client_cost
from stages.serve.proxy.front.peers import tell_peers
from stages.serve.proxy.front.request import bad_request, read_json_body
from stages.serve.proxy.front.responses import json_response
from stages.serve.proxy.state import ProxyState
from stages.serve.proxy.view.workers import WorkerView

log = logging.getLogger(__name__)

_ADMIN_BODY_LIMIT = 64 * 1024
_POLICY_KEYS = frozenset(("policy", "config", "seed"))
_ARTIFACT_KEYS = frozenset(("version",))


def _self_check_mode(state: ProxyState) -> str:
    if state.checks is not None:
        return "on"  # workers rejoin rotation only after passing it
    return "skipped" if state.config.skip_self_check else "off"


def _worker_checks(state: ProxyState, role: str, index: int) -> dict[str, Any] | None:
    if state.checks is None:
        return None
    record = state.checks.record(role, index)
    return {"verified": record.verified, "passed": record.passed, "failed": record.failed}


def _worker_state(state: ProxyState, role: str, w: WorkerView,
                  of_role: Mapping[str, Any] = MappingProxyType({})) -> dict[str, Any]:
    """One worker in ``/admin/state``: what every worker shows, with ``of_role``'s fields
    (a decode worker's) after its health."""
    return {
        "index": w.index,
        "url": w.url,
        "in_flight": w.in_flight,
        "healthy": w.healthy,
        **of_role,
        "last_error": w.last_error,
        "restarts": state.restarts(w.url),
        "self_check": _worker_checks(state, role, w.index),
        **_ejection(w),
    }


def _ejection(w: WorkerView) -> dict[str, Any]:
    return {"consecutive_failures": w.consecutive_failures, "ejections": w.ejections,
            "ejected_for_s": round(w.ejected_for_s, 1), "probation": w.probation,
            "draining": w.draining}


async def drain_worker(request: Request) -> Response:
    """``POST /admin/workers/{name}/drain``: no new request goes to the worker (those on it
    finish; poll its ``in_flight`` until 0, then restart it); ``DELETE`` puts it back."""
    state: ProxyState = request.app.state.proxy
    name = request.path_params["name"]
    for pool in (state.decode, state.prefill):
        index = pool.index_of(name)
        if index is None:
            continue
        draining = request.method == "POST"
        if draining and pool.eligible(exclude=[index]).sum() == 0:
            return json_error(409, f"{name} is the last {pool.role} worker in rotation: draining"
                              " it would fail every request", "conflict", param="name")
        pool.set_draining(index, draining)
        view = pool.views()[index]
        peers = await tell_peers(state, request, None)
        return json_response({"worker": name, "draining": view.draining,
                              "in_flight": view.in_flight, "healthy": view.healthy,
                              **_peer_answers(state, peers)})
    names = [p.name(i) for p in (state.prefill, state.decode) for i in range(len(p))]
    return json_error(404, f"no worker {name!r}; workers: {', '.join(names)}", "not_found",
                      param="name")


def _published(state: ProxyState, index: int) -> dict[str, Any]:
    """What the decode worker last published of its batch, when it publishes one."""
    batches = state.decode.published
    if batches is None:
        return {}
    age = batches.age_s(index)
    return {"batch_endpoint": state.config.decode_batch_endpoints[index],
            "published_requests": int(batches.published[index]),
            "others_in_flight": int(batches.others[index]),
            # Of those, the ones whose experts routing weighs (their signatures came).
            "others_weighed": len(batches.weighed[index]),
            "published_age_s": None if age is None else round(age, 3),
            # Messages a jump in its seq showed missed, and of them those not replayed.
            "messages_missed": int(batches.missed[index]),
            "messages_lost": int(batches.lost[index])}


def snapshot(state: ProxyState) -> dict[str, Any]:
    router = state.router
    clusters = router.clusters_of_worker(state.decode.eligible())
    refitter = router.refitter
    return {
        "proxy": state.config.proxy_id,
        "peers": list(state.config.peers),
        "policy": router.policy_name,
        "config": asdict(router.policy.params),
        "policy_seed": router.policy_seed,  # its random ties and draws
        # What each policy runs with when switched to, beyond its defaults.
        "policy_config": router.policy_config.to_json(),
        "artifact_version": router.artifact.version if router.artifact is not None else None,
        "online_refit": refitter is not None,
        "refits": refitter.refits if refitter is not None else 0,
        "self_check": _self_check_mode(state),
        # `eldr serve --record`: rows appended, waiting for their decode, dropped and why.
        "recording": state.recorder.summary() if state.recorder is not None else None,
        # KV-aware routing: what each worker's KV events told this proxy, and whether it trusts
        # them (None: the workers publish no KV events to it).
        "kv": state.kv.state() if state.kv is not None else None,
        # The blocks whose expert counts the workers' expert events told (None: none publish).
        "block_experts": (state.block_experts.state() if state.block_experts is not None
                          else None),
        "decode_workers": [
            _worker_state(state, "decode", w,
                          {"clusters": clusters[w.index], **_published(state, w.index)})
            for w in state.decode.views()
        ],
        "prefill_workers": [_worker_state(state, "prefill", w) for w in state.prefill.views()],
    }


async def get_state(request: Request) -> Response:
    return json_response(snapshot(request.app.state.proxy))


async def set_policy(request: Request) -> Response:
    """Switch policy, optionally updating its options: all are checked before anything
    changes."""
    state: ProxyState = request.app.state.proxy
    try:
        body = await _admin_body(request, _POLICY_KEYS)
        name = body.get("policy")
        if not isinstance(name, str) or name not in POLICIES:
            raise bad_request(
                f'"policy" must be one of {sorted(POLICIES)}, got {name!r}', "policy"
            )
        config = body.get("config")
        if config is not None and not isinstance(config, dict):
            raise bad_request(f'"config" must be an object of {name} options, got {config!r}',
                              "config")
        if config is not None:  # any policy whose options name a cost model
            try:
                config = client_cost(config, paths.eldr_home())
            except EldrError as exc:
                raise ProxyError(400, str(exc), "bad_request", param="config.cost") from exc
        seed = body.get("seed")
        if seed is not None and (type(seed) is not int or seed < 0):
            raise bad_request(f'"seed" must be an integer >= 0, got {seed!r}', "seed")
        if state.config.skip_self_check:
            try:
                check_unchecked_policy(name)
            except EldrError as exc:  # a conflict with how the proxy was started, not a typo
                raise ProxyError(409, str(exc), "conflict", param="policy") from exc
        state.router.set_policy(name, config, seed)
    except ProxyError as exc:
        return exc.response()
    except ParamError as exc:
        return json_error(400, str(exc), "bad_request", param=f"config.{exc.param}")
    except EldrError as exc:  # e.g. eldr without an artifact: refused before any change
        return json_error(400, str(exc), "bad_request")
    log.info("policy set to %s %s", state.router.policy_name, asdict(state.router.policy.params))
    # The body as the client sent it: an inline cost model stays inline for a peer on another
    # machine, and each peer checks it again.
    peers = await tell_peers(state, request, body)
    return json_response({**snapshot(state), **_peer_answers(state, peers)})


async def _admin_body(request: Request, allowed: frozenset[str]) -> dict[str, Any]:
    # A misspelt key ("eps") silently ignored would leave the operator believing it applied.
    body = await read_json_body(request, _ADMIN_BODY_LIMIT)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unknown keys {unknown}; accepted: {sorted(allowed)}", unknown[0])
    return body


async def set_artifact(request: Request) -> Response:
    """Load and switch to another artifact version; a refused one changes nothing."""
    state: ProxyState = request.app.state.proxy
    store = state.config.artifact_store
    try:
        body = await _admin_body(request, _ARTIFACT_KEYS)
        version = body.get("version")
        if not isinstance(version, str) or not version.strip():
            raise bad_request('body needs "version": an artifact version', "version")
        if store is None:
            raise ProxyError(409, "the proxy was started without an artifact store", "conflict")
        # Loading reads files; keep the event loop serving meanwhile.
        artifact = await asyncio.to_thread(state.artifact_loader, store, version)
        state.router.set_artifact(artifact)
    except ProxyError as exc:
        return exc.response()
    except (EldrError, OSError) as exc:
        return json_error(400, f"cannot load artifact: {exc}", "bad_request", param="version")
    loaded = artifact.version
    log.info("artifact %s loaded", loaded)
    # The version loaded, not the one asked for: "latest" may mean another by the time a
    # peer reads the store.
    peers = await tell_peers(state, request, {"version": loaded})
    return json_response({**snapshot(state), **_peer_answers(state, peers)})


def _peer_answers(state: ProxyState, answers: list[dict[str, Any]]) -> dict[str, Any]:
    """What the peers answered, for a response to an operator (nothing from a lone proxy, or
    to a peer, which sends nothing on)."""
    return {"peers_told": answers} if answers else {}
