"""A fake vLLM OpenAI server for tests and benches: prefill and decode roles, on demand failures.

It imitates only what the proxy relies on: a prefill request (``kv_transfer_params`` with
``do_remote_decode``) gets one token and a ``kv_transfer_params`` hand-off carrying an encoded
signature; any other request is a decode that streams SSE or answers JSON. Its behaviour is a
mutable object that tests change between requests; it records what it received.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from stages.capture.batch_publisher import (
    RECORD_KEY,
    BatchPublisher,
    request_name,
)
from stages.serve.proxy.ops.self_check import PROBE_PROMPT
from stages.signature import wire

SIGNATURE_SHAPE = (4, 16)
_DOMAIN = re.compile(r"domain=(\d+)")


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "\n".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    return str(body.get("prompt", ""))


def domain_prompt(domain: int) -> dict[str, Any]:
    """A completion body whose signature ``domain_signature`` peaks on ``domain``."""
    return {"prompt": f"domain={domain}"}


def domain_signature(body: dict[str, Any], shape: tuple[int, int] = SIGNATURE_SHAPE) -> np.ndarray:
    """Counts peaked on expert ``N % E`` in every layer for prompts containing ``domain=N``.

    Gives tests a signature whose nearest centroid they know; prompts without a marker get an
    even spread.
    """
    counts = np.ones(shape, dtype=np.int32)
    match = _DOMAIN.search(prompt_text(body))
    if match:
        counts[:, int(match.group(1)) % shape[1]] += 50
    return counts


class StreamAborted(Exception):
    """Raised inside a response stream to cut the connection like a crashed worker."""


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def is_prefill(self) -> bool:
        kv = self.body.get("kv_transfer_params")
        return isinstance(kv, dict) and bool(kv.get("do_remote_decode"))


@dataclass
class FakeBehavior:
    name: str = "fake"
    tokens: int = 4
    token_delay_s: float = 0.0
    delay_s: float = 0.0  # before answering anything (a slow or hung worker)
    fail_status: int | None = None  # answer completions with this status
    drop_after: int | None = None  # stream this many token events, then cut the connection
    stream_error: bool = False  # open streams with vLLM's error event (e.g. a failed KV load)
    healthy: bool = True
    # /health turns 503 on the first completion request: a worker that breaks while in
    # rotation (the proxy's probes would keep one that is down from the start out of it).
    sick_after_request: bool = False
    signature: Callable[[dict[str, Any]], np.ndarray | None] = domain_signature
    # Raw 200 body for eldr's self-check prompt instead of a completion with ``signature``.
    self_check_reply: bytes | None = None
    received: list[Received] = field(default_factory=list)
    record: bool = True  # False: keep nothing (a capacity bench's millions of requests)
    # Publishes the streams it holds as a decode worker with eldr's connector does.
    publisher: BatchPublisher | None = None
    handed_off: int = 0  # prefill hand-offs so far (distinct block ids without ``received``)
    # Asked to record (RECORD_KEY): the decode counts it publishes when the request ends, as
    # eldr's connector measures them (None: the prompt's signature times the tokens).
    decode_counts: Callable[[dict[str, Any], int], np.ndarray] | None = None
    # The name /v1/models lists; set, a request naming another model is answered 404 as vLLM
    # does (None: "fake-model", and any name is served).
    served_name: str | None = None

    def reset(self) -> None:
        self.tokens, self.token_delay_s, self.delay_s = 4, 0.0, 0.0
        self.fail_status = self.drop_after = None
        self.stream_error = False
        self.healthy = True
        self.sick_after_request = False
        self.signature = domain_signature
        self.self_check_reply = None
        self.received.clear()


def _completion(behavior: FakeBehavior, body: dict[str, Any], chat: bool, n: int) -> dict:
    text = "".join(f"t{i} " for i in range(n))
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": f"cmpl-{behavior.name}",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": body.get("model", "fake"),
        "choices": [choice],
        "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
    }


def _chunk(behavior: FakeBehavior, chat: bool, i: int) -> bytes:
    delta = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
    event = {"id": f"cmpl-{behavior.name}", "choices": [{"index": 0, **delta}]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _kv_transfer_params(behavior: FakeBehavior, body: dict[str, Any]) -> dict[str, Any]:
    kv: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        # Unique per hand-off, so tests can tell a fresh prefill's blocks from a reused one.
        "remote_block_ids": [behavior.handed_off, 1, 2],
        "remote_engine_id": f"engine-{behavior.name}",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }
    counts = behavior.signature(body)
    if counts is not None:
        kv.update(wire.encode(counts))
    return kv


def _self_check_answer(behavior: FakeBehavior, body: dict[str, Any]) -> Response:
    # An eldr worker returns the prompt's signature on any request it finished itself.
    if behavior.self_check_reply is not None:
        return Response(behavior.self_check_reply, media_type="application/json")
    data = _completion(behavior, body, False, 1)
    counts = behavior.signature(body)
    if counts is not None:
        data["kv_transfer_params"] = wire.encode(counts)
    return Response(orjson.dumps(data), media_type="application/json")


def fake_decode_counts(body: dict[str, Any], tokens: int) -> np.ndarray:
    """What a fake decode worker measured: the prompt's signature once per generated token."""
    counts = domain_signature(body)
    assert counts is not None
    return counts.astype(np.int32) * tokens


def _publish_finished(behavior: FakeBehavior, body: dict[str, Any], tokens: int) -> None:
    kv = body.get("kv_transfer_params")
    if behavior.publisher is None or not isinstance(kv, dict) or kv.get(RECORD_KEY) is not True:
        return
    counts = (behavior.decode_counts or fake_decode_counts)(body, tokens)
    behavior.publisher.finished(request_name("", kv), 8, tokens, counts)


def _hold(behavior: FakeBehavior, held: str, body: dict[str, Any]) -> None:
    """As eldr's connector does when the scheduler first sees the request."""
    assert behavior.publisher is not None
    kv = body.get("kv_transfer_params")
    behavior.publisher.add(held, request_name(held, kv), wire.entries(kv))


async def _finish(behavior: FakeBehavior, body: dict[str, Any], tokens: int, held: str) -> None:
    # A coroutine: Starlette would run a plain function in its thread pool, a thread hop per
    # request that cut a fake's requests/s to a third.
    _publish_finished(behavior, body, tokens)
    if behavior.publisher is not None:
        behavior.publisher.remove(held)


def create_fake_worker(behavior: FakeBehavior) -> Starlette:
    async def completion(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        body = orjson.loads(await request.body())
        rec = Received(request.url.path, dict(request.headers), body)
        if behavior.record:
            behavior.received.append(rec)
        if behavior.sick_after_request:
            behavior.healthy = False
        if behavior.delay_s:
            await asyncio.sleep(behavior.delay_s)
        if behavior.fail_status is not None:
            err = {"error": {"message": f"{behavior.name} told to fail", "code": 0}}
            return Response(orjson.dumps(err), behavior.fail_status, media_type="application/json")
        asked = body.get("model", behavior.served_name)
        if behavior.served_name is not None and asked != behavior.served_name:
            err = {"error": {"message": f"The model `{asked}` does not exist.",
                             "type": "NotFoundError", "param": "model", "code": 404}}
            return Response(orjson.dumps(err), 404, media_type="application/json")
        headers = {"X-Request-Id": request.headers.get("x-request-id", "")}
        if prompt_text(body) == PROBE_PROMPT:
            return _self_check_answer(behavior, body)
        if rec.is_prefill:
            behavior.handed_off += 1
            data = _completion(behavior, body, chat, 1)
            data["kv_transfer_params"] = _kv_transfer_params(behavior, body)
            return Response(orjson.dumps(data), media_type="application/json", headers=headers)
        n = int(body.get("max_tokens") or behavior.tokens)
        held = request.headers.get("x-request-id", "") + f"-{id(body)}"
        if not body.get("stream"):
            # Held while it is answered, as a decode worker holds it while it decodes, so a
            # publishing fake sends a message per request whether or not it is recorded.
            if behavior.publisher is not None:
                _hold(behavior, held, body)
            data = _completion(behavior, body, chat, n)
            # After the answer is sent: vLLM's connector reports a finished request from the
            # engine core, beside the API server's answer, not before it.
            return Response(orjson.dumps(data), media_type="application/json", headers=headers,
                            background=BackgroundTask(_finish, behavior, body, n, held))

        async def events() -> AsyncIterator[bytes]:
            if behavior.publisher is not None:
                _hold(behavior, held, body)
            try:
                async for event in _events():
                    yield event
                _publish_finished(behavior, body, n)
            finally:
                if behavior.publisher is not None:
                    behavior.publisher.remove(held)

        async def _events() -> AsyncIterator[bytes]:
            if behavior.stream_error:
                err = {"error": {"message": "KV load failed", "type": "InternalServerError"}}
                yield b"data: " + orjson.dumps(err) + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
            for i in range(n):
                if behavior.drop_after is not None and i >= behavior.drop_after:
                    raise StreamAborted(f"{behavior.name} cut its stream after {i} events")
                if behavior.token_delay_s:
                    await asyncio.sleep(behavior.token_delay_s)
                yield _chunk(behavior, chat, i)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def health(request: Request) -> Response:
        return Response(status_code=200 if behavior.healthy else 503)

    async def models(request: Request) -> Response:
        name = behavior.served_name or "fake-model"
        data = {"object": "list", "data": [{"id": name, "object": "model"}]}
        return Response(orjson.dumps(data), media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/chat/completions", completion, methods=["POST"]),
            Route("/health", health),
            Route("/v1/models", models),
        ]
    )


class BackgroundServer:
    """An ASGI app served by uvicorn on a free localhost port, in a thread."""

    def __init__(self, app: Any, log_level: str = "warning") -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout_s: float = 10.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._thread.is_alive():
            if self._server.started:
                return self
            time.sleep(0.01)
        raise RuntimeError(f"server on {self.url} did not start")

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop and wait for the lifespan's shutdown to end (a recording proxy writes its rows
        there: under CI's load that took over 10 s, and a test went on to read an empty
        dataset)."""
        self._server.should_exit = True
        self._thread.join(timeout=timeout_s)
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"server on {self.url} did not stop within {timeout_s:g} s")

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
