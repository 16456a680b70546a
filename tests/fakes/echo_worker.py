"""A worker for tests of what the proxy sends: it answers each decode with text naming the
prompt, seed and KV blocks it got, and reads JSON as leniently as vLLM (the stdlib's parser).

Prefills (``do_remote_decode``) hand out numbered blocks and the fake signature of
``tests.fakes.worker``; decodes answer JSON or SSE (two pieces, a usage chunk when asked).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from stages.signature import wire
from tests.fakes.worker import domain_signature, prompt_text

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass
class Echo:
    """A worker: prefills hand out numbered blocks, decodes echo prompt, seed and blocks."""

    name: str
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    blocks: Iterator[int] = field(default_factory=itertools.count)
    reject: str | None = None  # answer 400 to prompts containing this
    cut: str | None = None  # streams for prompts containing this break after one event
    delay_s: float = 0.0  # before answering a prefill
    decode_delay_s: float = 0.0  # before answering a decode
    decode_status: int | None = None  # answer decodes with this status (a failing worker)

    def app(self) -> Starlette:
        return Starlette(routes=[Route(CMPL, self.serve, methods=["POST"]),
                                 Route(CHAT, self.serve, methods=["POST"]),
                                 Route("/health", lambda r: Response())])

    async def serve(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.received.append(body)
        self.headers.append(dict(request.headers))
        chat = request.url.path == CHAT
        rid = request.headers["x-request-id"]
        prompt = prompt_text(body) if chat else _label(body.get("prompt"))
        if self.reject and self.reject in prompt:
            return Response(orjson.dumps({"error": {"message": "too long", "code": 400}}), 400,
                            media_type="application/json")
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            await asyncio.sleep(self.delay_s)
            params = {"remote_block_ids": [next(self.blocks)], "remote_engine_id": self.name,
                      **wire.encode(domain_signature(body))}
            return Response(orjson.dumps({"choices": [{"index": 0, "text": "x"}],
                                          "kv_transfer_params": params}),
                            media_type="application/json")
        await asyncio.sleep(self.decode_delay_s)
        if self.decode_status is not None:
            return Response(b'{"error": {"message": "down"}}', self.decode_status,
                            media_type="application/json")
        text = f"{prompt}|seed={body.get('seed')}|blocks={kv.get('remote_block_ids')}|{self.name}"
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 2,
                 "total_tokens": len(prompt) + 2}
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                      else {"index": 0, "text": text})
            return Response(orjson.dumps({"id": f"cmpl-{rid}", "object": "x", "choices": [choice],
                                          "usage": usage, "metrics": {"ttft": 1}}),
                            media_type="application/json")

        async def events() -> AsyncIterator[bytes]:
            for i, piece in enumerate((text, "!")):
                if i and self.cut and self.cut in prompt:
                    raise RuntimeError("cut")
                delta = {"delta": {"content": piece}} if chat else {"text": piece}
                event = {"id": f"cmpl-{rid}", "choices": [{"index": 0, **delta}]}
                yield b"data: " + orjson.dumps(event) + b"\n\n"
                await asyncio.sleep(0.001)
            if (body.get("stream_options") or {}).get("include_usage"):
                event = {"id": f"cmpl-{rid}", "choices": [], "usage": usage}
                yield b"data: " + orjson.dumps(event) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _label(prompt: object) -> str:
    # A split batch sends each prompt as a list of one.
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else str(prompt)
