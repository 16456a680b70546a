"""The proxy's small endpoints: model list (from a prefill worker), health, metrics, version."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from stages.serve.proxy.client.upstream import UPSTREAM_ERRORS, fetch
from stages.serve.proxy.errors import json_error
from stages.serve.proxy.front.peers import metrics_headers, metrics_of_all
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
    state: ProxyState = request.app.state.proxy
    prefill = int(state.prefill.eligible().sum())
    decode = int(state.decode.eligible().sum())
    ok = prefill > 0 and decode > 0 and not state.draining
    status = "draining" if state.draining else "ok" if ok else "unavailable"
    return json_response(
        {
            "status": status,
            "prefill_healthy": prefill,
            "decode_healthy": decode,
        },
        status=200 if ok else 503,
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
