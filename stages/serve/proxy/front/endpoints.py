"""The proxy's small endpoints: model list (from a prefill worker), health, metrics, version."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from stages.serve.proxy.client.upstream import UPSTREAM_ERRORS, fetch
from stages.serve.proxy.errors import json_error
from stages.serve.proxy.front.peers import metrics_headers, metrics_of_all
from stages.serve.proxy.front.readiness import Readiness
from stages.serve.proxy.front.responses import json_response
from stages.serve.proxy.state import ProxyState


async def models(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    failures = []
    for i in range(len(state.prefill)):
        if not state.prefill.healthy(i):
            continue
        url = state.prefill.urls[i]
        try:
            reply = await fetch(state.control_client, "GET", url, "/v1/models",
                                state.prefill_timeout)
        except UPSTREAM_ERRORS as exc:
            failures.append(f"{url}: {exc!r}")
            continue
        return Response(
            reply.content,
            status_code=reply.status,
            media_type=reply.headers.get("Content-Type", "application/json"),
        )
    return json_error(
        502, "no prefill worker answered /v1/models: " + "; ".join(failures), "prefill_failed"
    )


async def health(request: Request) -> Response:
    """200 "ok" once a prefill and a decode worker are in rotation and every stream the proxy
    follows for them was heard (front.readiness): before, "warming" (503), since a request
    recorded then could lose its row. ``unheard_streams`` names those not heard yet, or, once
    ready, never heard within their bound."""
    state: ProxyState = request.app.state.proxy
    readiness: Readiness = request.app.state.readiness
    prefill = int(state.prefill.eligible().sum())
    decode = int(state.decode.eligible().sum())
    verdict = readiness.check(state)
    if state.draining:
        status = "draining"
    elif prefill == 0 or decode == 0:
        status = "unavailable"
    else:
        status = "ok" if verdict.ready else "warming"
    return json_response(
        {
            "status": status,
            "prefill_healthy": prefill,
            "decode_healthy": decode,
            "unheard_streams": verdict.unheard,
        },
        status=200 if status == "ok" else 503,
    )


async def metrics(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    return Response(await metrics_of_all(state, request), media_type=CONTENT_TYPE_LATEST,
                    headers=metrics_headers(state))


async def version(request: Request) -> Response:
    """Like vLLM's ``/version``, plus the vLLM release installed beside eldr."""
    from importlib.metadata import version as package_version

    from stages.vllm_compat import installed_vllm

    return json_response({"version": package_version("eldr"), "vllm_version": installed_vllm()})
