"""A client's request as the proxy reads it: the body read and checked, shaped for the two
legs, and carried down the path as one ``RequestContext``.

Reading and checking: a size limit, then vLLM's 400s. Checks answer what vLLM answers (400,
from its pydantic request models and ``validate_json_request``), but only for the fields the
proxy itself reads; the workers check the rest and their 400s reach the client unchanged.
vLLM's models validate in pydantic's lax mode, so what it coerces ("true" for a bool, 5.0 or
"5" for an int) is accepted here too.

Shaping for the legs: the prefill leg asks vLLM for one token with ``do_remote_decode`` so the
NixlConnector keeps the KV blocks for a decode worker to pull; its response's
``kv_transfer_params`` say where they are (and carry the ELDR signature). The decode leg is the
client's own request plus those params, unchanged except that the signature is left out.
``plan_legs`` shapes both once per (sub-)request into a ``Legs`` value that travels with the
request: a decode retry needs the same prefill again, and the decode body only waits for the
hand-off.

The context: everything a request's path needs travels in one frozen ``RequestContext``
(``legs.context``, the legs' own type), made here when the body has been read and checked.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import orjson
from starlette.requests import Request

from stages.capture.batch_publisher import RECORD_KEY, REQUEST_TAG
from stages.serve.proxy.errors import ProxyError
from stages.serve.proxy.legs.context import Admitted, RequestContext
from stages.serve.proxy.state import ProxyState
from stages.signature import wire

# pydantic's lax str -> bool words (case-insensitive, not stripped).
_TRUE_WORDS = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE_WORDS = frozenset(("0", "off", "f", "false", "n", "no"))
# pydantic's lax str -> int: digits (underscores between them), an optional all-zero fraction.
_INT_TEXT = re.compile(r"[+-]?[0-9](?:_?[0-9])*(?:\.0+)?")
# pydantic refuses floats this large for an int ("exceeded maximum size").
_INT_FLOAT_LIMIT = 2.0**63
_UNSUPPORTED_MEDIA = "Unsupported Media Type: Only 'application/json' is allowed"
# vLLM's default VLLM_MAX_N_SEQUENCES: SamplingParams refuses a larger n.
MAX_N = 16384
# vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling.
_SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class RequestFields:
    """The fields the proxy branches on, read as the workers will read them."""

    stream: bool
    n: int  # choices per prompt
    beam_search: bool  # then n is the beam width, answered by one request per prompt
    prompts: int = 1  # a completions body may hold several

    @property
    def sequences(self) -> int:
        """Sequences asked for: more than one, and the request is split (``batch_split``)."""
        return self.prompts * (1 if self.beam_search else self.n)


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, "bad_request", param)


def is_json_media_type(content_type: str | None) -> bool:
    """vLLM's ``validate_json_request``: the media type must be exactly application/json.

    Not stripped, as vLLM does not strip it: ``application/json ; charset=utf-8`` is refused.
    """
    media_type = (content_type or "").lower().split(";", 1)[0]
    return media_type == "application/json"


@dataclass(frozen=True)
class JsonBody:
    body: dict[str, Any]
    # Read by the stdlib's parser, not orjson's (see ``parse_json``): it may hold values that
    # only the stdlib writes back as they came (NaN, Infinity, lone surrogates).
    lax: bool


async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object (see ``read_body``)."""
    return (await read_body(request, limit)).body


async def read_body(request: Request, limit: int) -> JsonBody:
    """The body as a JSON object: 413 over ``limit``, else 400 for a wrong media type or JSON.

    The size comes first (deliberately earlier than vLLM, which reads any size). The media
    type is judged before the JSON, as vLLM never parses a body that is not declared JSON.
    """
    json_declared = is_json_media_type(request.headers.get("content-type"))
    try:
        body = await _read_json_object(request, limit)
    except ProxyError as exc:
        if exc.status == 413 or json_declared:
            raise
        raise bad_request(_UNSUPPORTED_MEDIA) from exc
    if not json_declared:
        raise bad_request(_UNSUPPORTED_MEDIA)
    return body


def parse_json(raw: bytes) -> tuple[object, bool]:
    """``raw`` as vLLM reads it (Starlette's ``json.loads``), and whether orjson could not.

    orjson first, as it is fast and reads every body a client normally sends. What only the
    stdlib takes (a UTF-8 BOM, UTF-16 or UTF-32, NaN and Infinity, lone surrogates) vLLM takes
    too, so the proxy must not refuse it. (orjson reads an integer past 64 bits as a float;
    vLLM bounds every integer field to 64 bits, so it refuses such a value either way.)
    """
    try:
        return orjson.loads(raw), False
    except orjson.JSONDecodeError as exc:
        strict_error = exc
    try:
        return json.loads(raw), True
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise bad_request(f"request body is not valid JSON: {strict_error}") from exc


def dump_json(value: object, lax: bool) -> bytes:
    """``value`` as JSON the workers read back unchanged; ``lax`` as from ``parse_json``."""
    if lax:
        # orjson would write NaN as null and refuse lone surrogates.
        return json.dumps(value).encode()
    return orjson.dumps(value)


def lax_bool(value: object) -> bool | None:
    """``value`` as pydantic's lax ``bool | None`` reads it; ValueError where it would refuse it."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.lower()
        if word in _TRUE_WORDS or word in _FALSE_WORDS:
            return word in _TRUE_WORDS
    raise ValueError(f"not a boolean: {value!r}")


def lax_int(value: object) -> int:
    """``value`` as pydantic's lax ``int`` reads it; ValueError where it would refuse it."""
    if isinstance(value, int):  # bool included, as pydantic takes true as 1
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < _INT_FLOAT_LIMIT:
            return int(value)
    elif isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
        return int(value.strip().split(".", 1)[0])
    raise ValueError(f"not an integer: {value!r}")


def _is_token_ids(value: object) -> bool:
    if not isinstance(value, list):
        return False
    try:
        return all(lax_int(token) >= 0 for token in value)
    except ValueError:
        return False


def _is_prompt(value: object) -> bool:
    # CompletionRequest.prompt: str | list[str] | list[int >= 0] | list[list[int >= 0]] | None
    if value is None or isinstance(value, str) or _is_token_ids(value):
        return True
    if not isinstance(value, list):
        return False
    return all(isinstance(p, str) for p in value) or all(_is_token_ids(p) for p in value)


def _check_messages(body: dict[str, Any]) -> None:
    # ChatCompletionRequest.messages is required: a list of message objects.
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request('"messages" is required and must be a list of message objects',
                          "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f'"messages[{i}]" must be a message object', "messages")


def _check_token_limit(body: dict[str, Any], key: str) -> None:
    value = body.get(key)
    if value is None:
        return
    try:
        limit = lax_int(value)
    except ValueError:
        raise bad_request(f'"{key}" must be an integer', key) from None
    if limit < 0:
        # vLLM's SamplingParams refuses it (0 is left to it: allowed with echo).
        raise bad_request(f'"{key}" must be >= 0, got {limit}', key)


def _check_decode_only_rules(body: dict[str, Any], chat: bool) -> None:
    """vLLM's request-model rules that only the decode leg's body can break.

    The prefill's body has stream off, no stream_options and max_tokens 1, so it passes these;
    refused by the decode worker's request model, the request would never pull the prompt's
    KV blocks, which then stay pinned on the prefill worker until NIXL's timeout. Read on the
    raw values, as vLLM's ``mode="before"`` validators read them.
    """
    stream = body.get("stream")
    if body.get("stream_options") and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.",
                          "stream_options")
    prompt_logprobs = body.get("prompt_logprobs")
    numeric = isinstance(prompt_logprobs, int | float)
    if stream and numeric and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.",
                          "prompt_logprobs")
    if not chat and body.get("logprob_token_ids") and body.get("echo") and (
        body.get("max_tokens") == 0
    ):
        raise bad_request(
            "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because"
            " no output tokens are generated.",
            "logprob_token_ids",
        )


def _read_n(body: dict[str, Any], chat: bool) -> int:
    # CompletionRequest.n: int = 1; ChatCompletionRequest.n: int | None = 1. SamplingParams
    # wants 1 <= n <= MAX_N.
    value = body.get("n", 1)
    if value is None and chat:
        return 1
    try:
        n = lax_int(value)
    except ValueError:
        raise bad_request('"n" must be an integer', "n") from None
    if not 1 <= n <= MAX_N:
        raise bad_request(f'"n" must be between 1 and {MAX_N}, got {n}', "n")
    return n


def _read_bool(body: dict[str, Any], key: str) -> bool:
    try:
        value = lax_bool(body.get(key, False))
    except ValueError:
        raise bad_request(f'"{key}" must be a boolean', key) from None
    return bool(value)


def check_request_body(body: dict[str, Any], chat: bool) -> RequestFields:
    """400 for a malformed field the proxy reads; ``stream`` is normalised to a bool in place.

    The proxy branches on ``stream``, ``n`` and ``use_beam_search`` itself, so it must read
    them as the workers will ("false" is False, not a truthy string), and refuse what they
    would refuse before any prefill runs: a leg refused after the prefill leaves its KV blocks
    pinned on the prefill worker until NIXL's timeout.
    """
    _check_decode_only_rules(body, chat)
    if chat:
        _check_messages(body)
    elif not _is_prompt(body.get("prompt")):
        raise bad_request(
            '"prompt" must be a string, a list of strings, a list of token ids (integers >= 0)'
            " or a list of such lists",
            "prompt",
        )
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        _check_token_limit(body, key)
    if "stream" in body:
        body["stream"] = _read_bool(body, "stream")
    if body.get("use_beam_search", False) is None:
        # bool, not bool | None, in both request models
        raise bad_request('"use_beam_search" must be a boolean', "use_beam_search")
    prompts = None if chat else prompts_of(body)
    fields = RequestFields(
        stream=bool(body.get("stream", False)),
        n=_read_n(body, chat),
        beam_search=_read_bool(body, "use_beam_search"),
        prompts=1 if prompts is None else len(prompts),
    )
    if fields.n > 1 and not fields.beam_search and _is_greedy(body.get("temperature")):
        # SamplingParams._verify_greedy_sampling; the split's sub-requests (n = 1 each) would
        # pass it, so the proxy says it.
        raise bad_request(f"n must be 1 when using greedy sampling, got {fields.n}.")
    _check_embeds(body, prompts)
    return fields


def _is_greedy(temperature: object) -> bool:
    """``temperature`` below vLLM's sampling epsilon. Unset is the server's default, 1.0 unless
    the model's generation config says otherwise (which the proxy cannot see); a value that
    is no number the workers refuse themselves."""
    if isinstance(temperature, str):
        try:
            temperature = float(temperature)
        except ValueError:
            return False
    return isinstance(temperature, int | float) and temperature < _SAMPLING_EPS


async def _read_json_object(request: Request, limit: int) -> JsonBody:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProxyError(413, f"request body over the {limit}-byte limit", "too_large")
    chunks: list[bytes] = []
    size = 0
    # Count while reading: a chunked body has no content-length to trust.
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProxyError(413, f"request body over the {limit}-byte limit", "too_large")
        chunks.append(chunk)
    body, lax = parse_json(b"".join(chunks))
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return JsonBody(body, lax)


def prompts_of(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completions body with more than one, as vLLM's model reads them.

    pydantic's smart union takes an exact ``list[str]`` or ``list[list[int]]`` first; any other
    list (``["1", 2]`` included) is one prompt of token ids.
    """
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    return None


def _check_embeds(body: dict[str, Any], prompts: list[Any] | None) -> None:
    # vLLM runs every prompt_embeds entry and every prompt as sequences of one request; the
    # proxy does not split embeddings, so it takes them only as the request's one prompt.
    embeds = body.get("prompt_embeds")
    if embeds is None:
        return
    several = isinstance(embeds, list) and len(embeds) > 1
    if several or prompts is not None or body.get("prompt") is not None:
        raise bad_request(
            "the proxy takes prompt_embeds only as the request's single prompt (one entry,"
            " no prompt)",
            "prompt_embeds",
        )

# -- shaping for the legs -------------------------------------------------------------------------

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

# -- the context ----------------------------------------------------------------------------------

# Client headers worth carrying to the workers. Not Authorization: the client's key is the
# proxy's to check, and workers get the proxy's own key (upstream.worker_headers).
_FORWARDED = ("traceparent", "tracestate")
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


def request_context(
    request: Request,
    request_id: str,
    body: dict[str, Any],
    chat: bool,
    lax_json: bool,
    admission: Admitted,
    client_request_id: str | None = None,
) -> RequestContext:
    """The context of a request whose ``body`` was read and checked.

    ``lax_json`` says the body was read by the stdlib's JSON (``parse_json``). A
    sub-request of a batch has its own ``request_id`` and body; ``client_request_id`` is the
    client request's id, which its answer carries.
    """
    state: ProxyState = request.app.state.proxy
    # identity: bytes are relayed as they come, never decompressed and re-compressed.
    headers = {
        "Content-Type": "application/json",
        "Accept-Encoding": "identity",
        "X-Request-Id": request_id,
    }
    for name in _FORWARDED:
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    return RequestContext(
        state=state,
        # The route's own path, never the client's decoded one: a route pattern's "$" matches
        # before a trailing line feed, so "/v1/completions%0A" is routed here too.
        path=CHAT_PATH if chat else COMPLETIONS_PATH,
        chat=chat,
        request_id=request_id,
        legs=plan_legs(body, chat, lax_json),
        headers=MappingProxyType(headers),
        reply_headers=MappingProxyType({"X-Request-Id": client_request_id or request_id}),
        arrived=time.monotonic(),
        admission=admission,
        prompt=(state.kv.prompt(body, chat, all_ids=state.router.policy.decodes_at_arrival)
                if state.kv is not None and state.kv_active else None),
    )
