"""Admin API: inspect routing state, switch policy/tau or artifact at run time."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from stages.errors import EldrError
from stages.routing.policies import POLICIES
from stages.serve.request_body import bad_request, read_json_body
from stages.serve.responses import ProxyError, json_error, json_response
from stages.serve.state import ProxyState

log = logging.getLogger(__name__)

_ADMIN_BODY_LIMIT = 64 * 1024
_POLICY_KEYS = frozenset(("policy", "tau", "epsilon"))
_ARTIFACT_KEYS = frozenset(("version",))


def snapshot(state: ProxyState) -> dict[str, Any]:
    router = state.router
    clusters = router.clusters_of_worker(state.decode.eligible())
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
                "clusters": clusters[w.index],
                "last_error": w.last_error,
                "restarts": state.restarts(w.url),
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
                "restarts": state.restarts(w.url),
            }
            for w in state.prefill.views()
        ],
    }


async def get_state(request: Request) -> Response:
    return json_response(snapshot(request.app.state.proxy))


async def set_policy(request: Request) -> Response:
    """Switch policy, tau or epsilon: every value is checked before anything changes.

    Checking only what the new policy uses would store, say, a negative epsilon with "rr"
    and break a later switch to eldr-bl that keeps it.
    """
    state: ProxyState = request.app.state.proxy
    try:
        body = await _admin_body(request, _POLICY_KEYS)
        name = body.get("policy")
        if not isinstance(name, str) or name not in POLICIES:
            raise bad_request(
                f'"policy" must be one of {sorted(POLICIES)}, got {name!r}', "policy"
            )
        tau = _bounded(body, "tau", 0.0, 1.0)
        epsilon = _bounded(body, "epsilon", 0.0, math.inf)
        state.router.set_policy(name, tau, epsilon)
    except ProxyError as exc:
        return exc.response()
    except EldrError as exc:  # e.g. eldr without an artifact: refused before any change
        return json_error(400, str(exc), "bad_request")
    log.info("policy set to %s (tau=%s, epsilon=%s)", state.router.policy_name,
             state.router.tau, state.router.epsilon)
    return json_response(snapshot(state))


async def _admin_body(request: Request, allowed: frozenset[str]) -> dict[str, Any]:
    # A misspelt key ("eps") silently ignored would leave the operator believing it applied.
    body = await read_json_body(request, _ADMIN_BODY_LIMIT)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unknown keys {unknown}; accepted: {sorted(allowed)}", unknown[0])
    return body


def _bounded(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    """``body[key]`` as a float in ``[low, high]``; None when absent (keep the current one)."""
    value = body.get(key)
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not low <= value <= high:
        upper = "" if math.isinf(high) else f" and <= {high:g}"
        raise bad_request(f'"{key}" must be a number >= {low:g}{upper}, got {value!r}', key)
    return float(value)


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
    log.info("artifact %s loaded", state.router.artifact.version if state.router.artifact else "")
    return json_response(snapshot(state))
