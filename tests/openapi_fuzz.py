"""Requests generated from the OpenAPI document a real vLLM server publishes, sent to the proxy
and to vLLM itself, status class for status class.

schemathesis turns the request schemas of ``/v1/completions`` and ``/v1/chat/completions`` into
hypothesis strategies, in both its modes: bodies the schema accepts (most still refused by
vLLM's own checks: an unknown model, a max_tokens over the context, a bad sampling value) and
bodies it does not. ``steer`` then names the served model in about half of them, with a prompt
where there is none, so that generation is reached as well as validation, and bounds what makes
a request slow (tokens to generate, sequences) without changing whether it is valid.

``kv_transfer_params`` and ``ec_transfer_params`` are dropped: they are the disaggregation
protocol's own fields, which the proxy sets itself, and a decode worker given a client's would
try to pull KV blocks from wherever they point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from hypothesis import strategies as st

ROUTES = ("/v1/completions", "/v1/chat/completions")
PROTOCOL_FIELDS = ("kv_transfer_params", "ec_transfer_params")
# Fields whose size sets the work a valid request asks for, and the bound kept on each.
_BOUNDS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 3, "best_of": 3,
           "min_tokens": 4, "logprobs": 3, "top_logprobs": 3, "prompt_logprobs": 3}


@dataclass(frozen=True)
class Reply:
    status: int
    ended: bool  # a stream ended with [DONE], or a whole response was read
    body: bytes  # a whole response's bytes; empty for a stream
    streamed: bool


def steer(body: Any, name_model: bool, model: str) -> Any:
    """``body`` with the served model named (if ``name_model``) and its work bounded."""
    if not isinstance(body, dict):
        return body
    out = {k: v for k, v in body.items() if k not in PROTOCOL_FIELDS}
    if name_model:
        out["model"] = model
        # Optional in the schema, so mostly left out, yet without one nothing is generated.
        if out.get("prompt") is None and "messages" not in out:
            out["prompt"] = "The capital of France is"
    # None means "up to the context's end" (a thousand tokens here), also with no model named.
    if out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
        out["max_tokens"] = _BOUNDS["max_tokens"]
    for key, bound in _BOUNDS.items():
        value = out.get(key)
        # bool is an int to Python and to pydantic's lax mode alike: leave it as generated.
        if isinstance(value, int) and not isinstance(value, bool) and value > bound:
            out[key] = bound
    return out


def request_bodies(openapi: dict[str, Any], route: str, model: str) -> st.SearchStrategy[Any]:
    """Bodies for ``route`` drawn from the schema, valid and not, steered (above)."""
    import schemathesis
    from schemathesis import GenerationMode

    operation = schemathesis.openapi.from_dict(openapi)[route]["POST"]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                      operation.as_strategy(GenerationMode.NEGATIVE))
    return st.tuples(cases, st.booleans()).map(lambda t: steer(t[0].body, t[1], model))


def send(url: str, route: str, body: Any, timeout_s: float) -> Reply:
    """POST ``body`` and read the whole answer; a stream counts as ended on ``data: [DONE]``."""
    content = body if isinstance(body, bytes) else _json(body)  # bytes: negative mode's raw body
    with httpx.stream("POST", url + route, content=content, timeout=timeout_s,
                      headers={"content-type": "application/json"}) as r:
        streamed = r.headers.get("content-type", "").startswith("text/event-stream")
        if streamed:
            ended = any(line == "data: [DONE]" for line in r.iter_lines())
            body = b""
        else:
            body = r.read()
            ended = True
    return Reply(r.status_code, ended, body, streamed)


def error_shape_problem(reply: Reply) -> str | None:
    """What keeps ``reply`` from being an error in vLLM's ``ErrorResponse`` shape,
    ``{"error": {"message": str, "type": str, "param": str | None, "code": <the status>}}``
    (vLLM's ``ErrorInfo``), or None when it has that shape."""
    if reply.streamed:
        return "an event stream, not a JSON error"
    try:
        document = orjson.loads(reply.body)
    except orjson.JSONDecodeError:
        return f"not JSON: {reply.body[:80]!r}"
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict):
        return f"no error object: {reply.body[:80]!r}"
    wrong = [key for key, kind in (("message", str), ("type", str)) if not isinstance(
        error.get(key), kind)]
    if not (error.get("param") is None or isinstance(error.get("param"), str)):
        wrong.append("param")
    if error.get("code") != reply.status:
        wrong.append("code")
    return f"{', '.join(wrong)} wrong in {reply.body[:120]!r}" if wrong else None


def _json(body: Any) -> bytes:
    try:
        return orjson.dumps(body)
    except TypeError:  # lone surrogates: orjson refuses them; JSON text carries them escaped
        return json.dumps(body).encode()
