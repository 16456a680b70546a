"""Reading and checking a client's JSON body: a size limit, then vLLM's 400s.

Checks answer what vLLM answers (400, from its pydantic request models and
``validate_json_request``), but only for the fields the proxy itself reads; the workers check
the rest and their 400s reach the client unchanged. vLLM's models validate in pydantic's lax
mode, so what it coerces ("true" for a bool, 5.0 or "5" for an int) is accepted here too.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request

from stages.serve.proxy.front.responses import ProxyError

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
    fields = RequestFields(
        stream=bool(body.get("stream", False)),
        n=_read_n(body, chat),
        beam_search=_read_bool(body, "use_beam_search"),
    )
    if fields.n > 1 and not fields.beam_search and _is_greedy(body.get("temperature")):
        # SamplingParams._verify_greedy_sampling; the split's sub-requests (n = 1 each) would
        # pass it, so the proxy says it.
        raise bad_request(f"n must be 1 when using greedy sampling, got {fields.n}.")
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
