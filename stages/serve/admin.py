"""Admin API: inspect routing state, switch policy/tau or artifact at run time."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from stages.errors import EldrError
from stages.serve.request_body import read_json_object
from stages.serve.responses import ProxyError, json_error, json_response
from stages.serve.state import ProxyState

log = logging.getLogger(__name__)

_ADMIN_BODY_LIMIT = 64 * 1024


def snapshot(state: ProxyState) -> dict[str, Any]:
    router = state.router
    clusters = router.cluster_of_worker()
    refitter = router.refitter
    return {
        "policy": router.policy_name,
        "tau": router.tau,
        "epsilon": router.epsilon,
        "artifact_version": router.artifact.version if router.artifact is not None else None,
        "online_refit": refitter is not None,
        "refits": refitter.refits if refitter is not None else 0,
        "decode_workers": [
            {
                "index": w.index,
                "url": w.url,
                "in_flight": w.in_flight,
                "healthy": w.healthy,
                "cluster": clusters[w.index],
                "last_error": w.last_error,
            }
            for w in state.decode.views()
        ],
        "prefill_workers": [
            {
                "index": w.index,
                "url": w.url,
                "in_flight": w.in_flight,
                "healthy": w.healthy,
                "last_error": w.last_error,
            }
            for w in state.prefill.views()
        ],
    }


async def get_state(request: Request) -> Response:
    return json_response(snapshot(request.app.state.proxy))


async def set_policy(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    try:
        body = await read_json_object(request, _ADMIN_BODY_LIMIT)
        name = body.get("policy")
        if not isinstance(name, str):
            raise ProxyError(400, 'body needs "policy": a policy name', "bad_request")
        tau, epsilon = _number(body, "tau"), _number(body, "epsilon")
        state.router.set_policy(name, tau, epsilon)
    except ProxyError as exc:
        return json_error(exc.status, exc.message, exc.kind)
    except EldrError as exc:
        return json_error(400, str(exc), "bad_request")
    log.info("policy set to %s (tau=%s, epsilon=%s)", state.router.policy_name,
             state.router.tau, state.router.epsilon)
    return json_response(snapshot(state))


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProxyError(400, f'"{key}" must be a number', "bad_request")
    return float(value)


async def set_artifact(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    store = state.config.artifact_store
    try:
        body = await read_json_object(request, _ADMIN_BODY_LIMIT)
        version = body.get("version")
        if not isinstance(version, str) or not version:
            raise ProxyError(400, 'body needs "version": an artifact version', "bad_request")
        if store is None:
            raise ProxyError(409, "the proxy was started without an artifact store", "conflict")
        # Loading reads files; keep the event loop serving meanwhile.
        artifact = await asyncio.to_thread(state.artifact_loader, store, version)
        state.router.set_artifact(artifact)
    except ProxyError as exc:
        return json_error(exc.status, exc.message, exc.kind)
    except (EldrError, OSError) as exc:
        return json_error(400, f"cannot load artifact: {exc}", "bad_request")
    log.info("artifact %s loaded", state.router.artifact.version if state.router.artifact else "")
    return json_response(snapshot(state))
