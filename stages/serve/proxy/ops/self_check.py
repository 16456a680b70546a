"""Self-check: a worker eldr routes with must really record expert signatures.

A worker in vLLM's compiled mode whose graph lacks eldr's recording hook (plugin missing, or a
compile cache traced without it) would answer every request with an empty signature, and eldr
would route blind without a word. One short prompt per worker settles it: a signature of the
served model's shape, built MoE layers as the config says, and every layer counted.

`eldr serve` asks every worker before the proxy opens (``check_records_signatures``, blocking);
the proxy asks again whenever a worker rejoins rotation (``check_records_signatures_async``, on
the proxy's control client; proxy.ops.rejoin). Both send ``probe_body`` and judge the answer
with ``check_answer``, so the two can never disagree on what a valid answer is.

Workers the user started (``--attach-*``) serve the model under whatever name they were given,
their model path by vLLM's default: the name is read from each one's ``/v1/models``
(``served_name``), and workers that disagree are refused (``agreed_served_name``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import orjson

from stages.errors import EldrError
from stages.models import check_built_layers
from stages.serve.proxy.client.http1 import Http1Client, Timeouts
from stages.serve.proxy.client.upstream import (
    KEEPALIVE_S,
    UPSTREAM_ERRORS,
    Reply,
    bearer_header,
    fetch,
    leg_limits,
)
from stages.signature import wire
from stages.signature.dataset import ModelIdentity

PROBE_PROMPT = "eldr self-check: one short prompt must come back with an expert signature."
# A worker's first request may still compile or warm caches; a slower answer is a broken one.
CHECK_TIMEOUT_S = 120.0


def probe_body(model_name: str | None) -> dict[str, Any]:
    """The one completion request every self-check sends (greedy, one token)."""
    body: dict[str, Any] = {"prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
    if model_name:
        body["model"] = model_name
    return body


def check_answer(url: str, status: int, content: bytes, identity: ModelIdentity) -> None:
    """Raise an ``EldrError`` saying what is wrong unless the worker's answer to
    ``probe_body`` (HTTP ``status``, raw ``content``) carries a signature that fits
    ``identity``: its shape and built MoE layers, and no layer without a count."""
    if status != 200:
        text = content[:300].decode(errors="replace")
        raise EldrError(f"self-check of worker {url} failed: it answered {status}: {text}")
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise EldrError(
            f"self-check of worker {url} failed: its answer is not JSON ({exc})"
        ) from exc
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    params = params if isinstance(params, dict) else None
    if wire.decode(params) is None:
        raise EldrError(
            f"worker {url} returns no expert signature: start it with eldr installed and"
            f" --kv-transfer-config naming EldrSignatureConnector (see README, 'In front of"
            f" your vLLM workers'), or serve with a policy that reads none and"
            f" --skip-self-check"
        )
    check_signature(f"worker {url}", params, identity)


def check_signature(who: str, params: dict[str, Any] | None, identity: ModelIdentity) -> None:
    """Raise an ``EldrError`` naming ``who`` unless ``params`` (an answer's
    ``kv_transfer_params``) carry a signature of ``identity``'s shape and built MoE layers
    with no layer left without a count. Also eldr capture's check of its engine."""
    counts = wire.decode(params)
    if counts is None:
        raise EldrError(f"{who} returns no expert signature: is eldr installed where vLLM runs?")
    if counts.shape != identity.shape:
        raise EldrError(
            f"{who} records signatures of shape {counts.shape}, but the served model"
            f" {identity.describe()} has {identity.shape}: is it serving another model?"
        )
    built = wire.decode_moe_layers(params)
    if built is not None:
        check_built_layers(identity, built, who)
    if len(wire.empty_layers(counts)):
        raise EldrError(
            f"{who} returned an empty expert signature for its self-check prompt: its"
            " model runs without eldr's recording hook (a compile cache from a run without"
            " eldr, or a MoE kernel that routes inside the kernel). Restart it, or run it"
            " with --enforce-eager"
        )


_JSON = {"Content-Type": "application/json"}


def check_records_signatures(
    url: str, identity: ModelIdentity, model_name: str | None, api_key: str | None = None,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> None:
    """Start-up check (blocking, before the proxy's event loop exists)."""
    try:
        reply = fetch_blocking("POST", url, "/v1/completions", {**bearer_header(api_key), **_JSON},
                               timeout_s, orjson.dumps(probe_body(model_name)))
    except UPSTREAM_ERRORS as exc:
        raise EldrError(f"self-check of worker {url} failed: {exc!r}") from exc
    check_answer(url, reply.status, reply.content, identity)


async def check_records_signatures_async(
    client: Http1Client, url: str, identity: ModelIdentity, model_name: str | None,
    timeout: Timeouts,
) -> None:
    """Run-time check on the proxy's control client (which already sends the worker key)."""
    try:
        reply = await fetch(client, "POST", url, "/v1/completions", timeout, _JSON,
                            orjson.dumps(probe_body(model_name)))
    except UPSTREAM_ERRORS as exc:
        raise EldrError(f"self-check of worker {url} failed: {exc!r}") from exc
    check_answer(url, reply.status, reply.content, identity)


def fetch_blocking(
    method: str, url: str, path: str, headers: Mapping[str, str], timeout_s: float,
    body: bytes = b"",
) -> Reply:
    """One call to a worker from outside any event loop (eldr serve's start-up), on a client
    of its own; ``timeout_s`` bounds connecting and every wait for the worker's bytes."""

    async def call() -> Reply:
        async with Http1Client(1, KEEPALIVE_S) as client:
            return await fetch(client, method, url, path, leg_limits(timeout_s, timeout_s),
                               headers, body)

    return asyncio.run(call())


def served_name(url: str, status: int, content: bytes) -> str:
    """The model a worker serves, from its answer to ``GET /v1/models``."""
    if status != 200:
        text = content[:300].decode(errors="replace")
        raise EldrError(f"worker {url} answered {status} to /v1/models: {text}")
    try:
        listed = orjson.loads(content)["data"]
        names = [str(entry["id"]) for entry in listed]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise EldrError(f"worker {url}: its /v1/models answer lists no model ({exc!r})") from exc
    if not names:
        raise EldrError(f"worker {url}: its /v1/models answer lists no model")
    return names[0]  # vLLM lists the served name first, then any LoRA adapters


def read_served_name(url: str, api_key: str | None = None,
                     timeout_s: float = CHECK_TIMEOUT_S) -> str:
    """A worker's served model name (blocking, at start-up)."""
    try:
        reply = fetch_blocking("GET", url, "/v1/models", bearer_header(api_key), timeout_s)
    except UPSTREAM_ERRORS as exc:
        raise EldrError(f"cannot read the model worker {url} serves: {exc!r}") from exc
    return served_name(url, reply.status, reply.content)


async def read_served_name_async(client: Http1Client, url: str, timeout: Timeouts) -> str:
    """A worker's served model name, on the proxy's control client (a worker that rejoins)."""
    try:
        reply = await fetch(client, "GET", url, "/v1/models", timeout)
    except UPSTREAM_ERRORS as exc:
        raise EldrError(f"cannot read the model worker {url} serves: {exc!r}") from exc
    return served_name(url, reply.status, reply.content)


def agreed_served_name(names: Mapping[str, str], expected: str | None = None) -> str:
    """The one name every worker (url -> name) serves the model under; refuse, naming both,
    workers that disagree with each other or with ``expected`` (a name the user gave)."""
    urls = list(names)
    first = names[urls[0]]
    for url in urls[1:]:
        if names[url] != first:
            raise EldrError(
                f"workers serve the model under different names: {urls[0]} as {first!r},"
                f" {url} as {names[url]!r}; start them with one --served-model-name"
            )
    if expected is not None and expected != first:
        raise EldrError(
            f"--served-model-name {expected!r}, but the workers serve the model as {first!r}"
            f" ({urls[0]}); drop --served-model-name or start them with it"
        )
    return first
