"""One streamed OpenAI ``/v1/completions`` (or ``/v1/chat/completions``) request, timed the
way ``vllm bench serve`` does.

The clock starts when the request is sent; every SSE chunk that carries ``choices`` is a token
arrival (first one = TTFT, the rest give ITLs); E2EL ends at the last such chunk; the output
token count comes from the final ``usage`` chunk (``stream_options.include_usage``), or, when
a server omits it, from the number of chunks. Errors become failed records, never exceptions:
a benchmark must count failures, not stop at the first one. A chat stream's chunks count as
token arrivals only when they carry content (its first chunk names the role only), as vLLM's
chat benchmark backend counts them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import orjson

from stages.bench.metrics import RequestRecord


@dataclass(frozen=True)
class CompletionSettings:
    """What every benchmark request asks for (fixed so policies compare like for like)."""

    max_tokens: int = 512
    model: str | None = None  # None: omitted, the server uses its only model
    ignore_eos: bool = True  # every request decodes exactly max_tokens
    timeout_s: float = 600.0


def completion_payload(prompt: str, settings: CompletionSettings) -> dict[str, object]:
    payload: dict[str, object] = {
        "prompt": prompt,
        "max_tokens": settings.max_tokens,
        "temperature": 0.0,
        "ignore_eos": settings.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.model:
        payload["model"] = settings.model
    return payload


def chat_payload(messages: Sequence[dict[str, str]], settings: CompletionSettings
                 ) -> dict[str, object]:
    payload = completion_payload("", settings)
    del payload["prompt"]
    payload["messages"] = list(messages)
    return payload


def _completion_text(choice: object) -> str | None:
    """A completion chunk's text: every chunk with a choice is a token arrival."""
    text = choice.get("text") if isinstance(choice, dict) else None
    return text if isinstance(text, str) else ""


def _chat_text(choice: object) -> str | None:
    """A chat chunk's content, or None for a chunk that carries none (the role-only head)."""
    delta = choice.get("delta") if isinstance(choice, dict) else None
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) and content else None


async def stream_completion(
    client: httpx.AsyncClient,
    base_url: str,
    prompt: str,
    settings: CompletionSettings,
    request_id: str,
    origin: float,
    prompt_id: str = "",
    domain: str = "",
) -> RequestRecord:
    """Send one streaming completion; ``origin`` is the ``perf_counter`` of the run's start."""
    return await _stream(client, base_url.rstrip("/") + "/v1/completions",
                         completion_payload(prompt, settings), _completion_text, settings,
                         request_id, origin, prompt_id, domain)


async def stream_chat(
    client: httpx.AsyncClient,
    base_url: str,
    messages: Sequence[dict[str, str]],
    settings: CompletionSettings,
    request_id: str,
    origin: float,
    prompt_id: str = "",
    domain: str = "",
) -> RequestRecord:
    """Send one streaming chat completion (the answer's text is the record's
    ``generated_text``)."""
    return await _stream(client, base_url.rstrip("/") + "/v1/chat/completions",
                         chat_payload(messages, settings), _chat_text, settings,
                         request_id, origin, prompt_id, domain)


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, object],
    text_of: Callable[[object], str | None],
    settings: CompletionSettings,
    request_id: str,
    origin: float,
    prompt_id: str,
    domain: str,
) -> RequestRecord:
    chunks: list[float] = []
    texts: list[str] = []
    usage: dict[str, int] = {}
    error = ""
    start = time.perf_counter()
    try:
        async with client.stream(
            "POST",
            url,
            json=payload,
            headers={"X-Request-Id": request_id},
            timeout=settings.timeout_s,
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                error = f"HTTP {response.status_code}: {body[:500]}"
            else:
                error = await _consume_sse(response, chunks, texts, usage, text_of)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if not error and not chunks:
        error = "stream ended without any token"
    common = {"request_id": request_id, "prompt_id": prompt_id, "domain": domain}
    if error:
        return RequestRecord(success=False, error=error, start_s=start - origin, **common)
    return RequestRecord(
        success=True,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        output_tokens=int(usage.get("completion_tokens", len(chunks))),
        ttft_s=chunks[0] - start,
        latency_s=chunks[-1] - start,
        itl_s=tuple(b - a for a, b in itertools.pairwise(chunks)),
        start_s=start - origin,
        generated_text="".join(texts),
        **common,
    )


async def _consume_sse(
    response: httpx.Response, chunks: list[float], texts: list[str], usage: dict[str, int],
    text_of: Callable[[object], str | None] = _completion_text,
) -> str:
    """Read the SSE stream into token times and usage; returns an error text or ''."""
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event: lines
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return f"malformed SSE data: {data[:200]}"
        if not isinstance(obj, dict):
            return f"unexpected SSE data: {data[:200]}"
        if "error" in obj:
            # A proxy ends a broken stream with an error event; that request failed.
            return f"stream error: {orjson.dumps(obj['error']).decode()[:500]}"
        if obj.get("choices"):
            text = text_of(obj["choices"][0])
            if text is not None:
                chunks.append(time.perf_counter())
                texts.append(text)
        if isinstance(obj.get("usage"), dict):
            usage.update({k: v for k, v in obj["usage"].items() if isinstance(v, int)})
    return "" if done else "stream closed before [DONE]"
