"""Shaping a client's OpenAI request body for the two PD legs.

The prefill leg asks vLLM for one token with ``do_remote_decode`` so the NixlConnector keeps the
KV blocks for a decode worker to pull; its response's ``kv_transfer_params`` say where they
are (and carry the ELDR signature). The decode leg is the client's own request plus those
params, unchanged except that the signature is left out. Reading and checking the body comes
first, in :mod:`stages.serve.request_body`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import orjson

from stages.serve.request_body import lax_int
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
_SIGNATURE_KEYS = frozenset((wire.SIGNATURE_KEY, wire.SHAPE_KEY))

def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    out = dict(body)
    out["max_tokens"] = 1
    out["stream"] = False
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


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(body)
    if kv_transfer_params is None:
        # No hand-off (prefill ran without a KV connector): the decode worker recomputes the
        # prompt, which is slower but correct, so do not forward a stale client value either.
        out.pop("kv_transfer_params", None)
    else:
        # The NIXL hand-off goes on unchanged; the signature stays behind: the decode worker has
        # no use for it, and it is most of the bytes (16 KiB of base64 for 48x128 experts).
        out["kv_transfer_params"] = {
            k: v for k, v in kv_transfer_params.items() if k not in _SIGNATURE_KEYS
        }
    return out


def prompt_key(body: dict[str, Any], chat: bool) -> bytes:
    """Bytes whose prefix identifies the prompt for prefix-affinity prefill routing."""
    if chat:
        parts: list[bytes] = []
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else message
            parts.append(content.encode() if isinstance(content, str) else orjson.dumps(content))
        return b"\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode()
    return orjson.dumps(prompt)
