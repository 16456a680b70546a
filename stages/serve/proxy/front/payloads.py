"""Shaping a client's OpenAI request body for the two PD legs.

The prefill leg asks vLLM for one token with ``do_remote_decode`` so the NixlConnector keeps the
KV blocks for a decode worker to pull; its response's ``kv_transfer_params`` say where they
are (and carry the ELDR signature). The decode leg is the client's own request plus those
params, unchanged except that the signature is left out. Reading and checking the body comes
first, in :mod:`stages.serve.proxy.front.request_body`.

``plan_legs`` shapes both once per (sub-)request into a ``Legs`` value that travels with the
request: a decode retry needs the same prefill again, and the decode body only waits for the
hand-off.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import orjson

from stages.capture.batch_publisher import RECORD_KEY, REQUEST_TAG
from stages.serve.proxy.front.request_body import dump_json, lax_int
from stages.signature import wire

PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = MappingProxyType(
    {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)


@dataclass(frozen=True)
class Legs:
    """What the two legs of one (sub-)request send, made once."""

    prefill: bytes  # the serialised prefill body
    key: bytes  # the prompt's prefix-routing key
    body: Mapping[str, Any]  # the client's body for this (sub-)request, read only
    stream: bool
    lax_json: bool  # the body holds values only the stdlib's JSON writes back as they came

    def decode_payload(self, kv_transfer_params: dict[str, Any] | None,
                       tag: str | None = None, record: bool = False) -> bytes:
        return dump_json(decode_body(self.body, kv_transfer_params, tag, record), self.lax_json)


def plan_legs(body: dict[str, Any], chat: bool, lax_json: bool = False) -> Legs:
    """``body`` was checked (``stream`` is a bool); it must not change afterwards."""
    return Legs(
        prefill=dump_json(prefill_body(body, chat), lax_json),
        key=prompt_key(body, chat),
        body=MappingProxyType(body),
        stream=bool(body.get("stream", False)),
        lax_json=lax_json,
    )


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    out = dict(body)
    out["max_tokens"] = 1
    out["stream"] = False
    # One sequence: with n > 1 each extra child would pin its own KV blocks on the prefill
    # worker for a hand-off nobody ever pulls (the response carries only the first child's).
    out["n"] = 1
    # vLLM rejects stream_options without stream=True, and min_tokens above max_tokens.
    out.pop("stream_options", None)
    if _min_tokens(out) > 1:
        out["min_tokens"] = 1
    if chat and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def _min_tokens(body: dict[str, Any]) -> int:
    # Read as the worker will ("5" and 5.0 are 5); what it would refuse, it refuses itself.
    try:
        return lax_int(body.get("min_tokens", 0))
    except ValueError:
        return 0


def decode_body(
    body: Mapping[str, Any], kv_transfer_params: dict[str, Any] | None, tag: str | None = None,
    record: bool = False,
) -> dict[str, Any]:
    """``tag``: the name a decode worker that publishes its batch gives the request
    (``batch_publisher.REQUEST_TAG``), so the proxy that sent it knows it for its own.
    ``record`` (with a tag): the worker publishes the request's decode counts when it ends
    (``batch_publisher.RECORD_KEY``)."""
    out = dict(body)
    if kv_transfer_params is None and tag is None:
        # No hand-off (prefill ran without a KV connector): the decode worker recomputes the
        # prompt, which is slower but correct, so do not forward a stale client value either.
        out.pop("kv_transfer_params", None)
        return out
    if tag is not None:
        # A worker that publishes its batch passes the signature on to every proxy, which
        # weighs the experts of the requests others sent (``batch_publisher``).
        params = dict(kv_transfer_params or {})
        params[REQUEST_TAG] = tag
        if record:
            params[RECORD_KEY] = True
    else:
        # The NIXL hand-off goes on unchanged; the signature stays behind: this decode worker
        # has no use for it, and it is most of the bytes (16 KiB of base64 for 48x128 experts).
        params = {k: v for k, v in (kv_transfer_params or {}).items()
                  if k not in wire.SIGNATURE_KEYS}
    out["kv_transfer_params"] = params
    return out


def prompt_key(body: Mapping[str, Any], chat: bool) -> bytes:
    """Bytes whose prefix identifies the prompt for prefix-affinity prefill routing."""
    if chat:
        parts: list[bytes] = []
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else message
            parts.append(_key_bytes(content))
        return b"\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        # One prompt of a split batch: the same key as that prompt sent on its own.
        prompt = prompt[0]
    return _key_bytes(prompt)


def _key_bytes(value: object) -> bytes:
    # Lone surrogates and big integers reach here from bodies only the stdlib's JSON reads;
    # the key only has to be stable, not valid UTF-8.
    if isinstance(value, str):
        return value.encode(errors="surrogatepass")
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value).encode()
