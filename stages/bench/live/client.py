"""One streamed OpenAI ``/v1/completions`` request, timed the way ``vllm bench serve`` does.

The clock starts when the request is sent; every SSE chunk that carries ``choices`` is a token
arrival (first one = TTFT, the rest give ITLs); E2EL ends at the last such chunk; the output
token count comes from the final ``usage`` chunk (``stream_options.include_usage``), or, when
a server omits it, from the number of chunks. Errors become failed records, never exceptions:
a benchmark must count failures, not stop at the first one.
"""

from __future__ import annotations

import itertools
import time
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
    url = base_url.rstrip("/") + "/v1/completions"
    chunks: list[float] = []
    texts: list[str] = []
    usage: dict[str, int] = {}
    error = ""
    start = time.perf_counter()
    try:
        async with client.stream(
            "POST",
            url,
            json=completion_payload(prompt, settings),
            headers={"X-Request-Id": request_id},
            timeout=settings.timeout_s,
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                error = f"HTTP {response.status_code}: {body[:500]}"
            else:
                error = await _consume_sse(response, chunks, texts, usage)
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
    response: httpx.Response, chunks: list[float], texts: list[str], usage: dict[str, int]
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
            chunks.append(time.perf_counter())
            choice = obj["choices"][0]
            if isinstance(choice, dict) and isinstance(choice.get("text"), str):
                texts.append(choice["text"])
        if isinstance(obj.get("usage"), dict):
            usage.update({k: v for k, v in obj["usage"].items() if isinstance(v, int)})
    return "" if done else "stream closed before [DONE]"
