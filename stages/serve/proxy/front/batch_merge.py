"""Merging the answers of a split request (:mod:`.batch_split`) into vLLM's one.

What one vLLM server answers for the whole request: one id, choices indexed ``p * n + i``,
usage summed with each prompt counted once, no per-request ``metrics`` (vLLM leaves them out
when a request has several sequences). A stream is the sub-streams' events as they come, with
the indices rewritten, one usage chunk at the end if usage was asked for, and one
``data: [DONE]``; an error in any sub-stream ends the merged stream after that error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import orjson

from stages.serve.proxy.errors import ProxyError
from stages.serve.proxy.front.batch_split import Part
from stages.serve.proxy.legs.answer import Stream, Whole
from stages.serve.proxy.legs.sse import DONE_EVENT, error_event

_SEP = b"\n\n"
_DATA = b"data: "


@dataclass(frozen=True)
class Renames:
    """How a sub-request's ids read in the client's answer."""

    sub_ids: Sequence[str]  # each sub-request's X-Request-Id
    client_id: str

    def answer_id(self, k: int, value: object) -> object:
        # vLLM names an answer after the X-Request-Id it got ("cmpl-<id>"): the client sees
        # its own id there, whichever sub-request the event came from.
        if isinstance(value, str):
            return value.replace(self.sub_ids[k], self.client_id, 1)
        return value


def merge_usage(usages: Sequence[tuple[dict[str, Any] | None, bool]]) -> dict[str, Any] | None:
    """``(usage, counts_prompt)`` per sub-answer, in order, as one usage; None if none had one.

    Prompt details come from the last prompt counted, as vLLM takes them from its last output.
    """
    present = [(u, counts) for u, counts in usages if isinstance(u, dict)]
    if not present:
        return None
    prompt = sum(int(u.get("prompt_tokens") or 0) for u, counts in present if counts)
    completion = sum(int(u.get("completion_tokens") or 0) for u, _ in present)
    merged: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    details = [u["prompt_tokens_details"] for u, counts in present
               if counts and u.get("prompt_tokens_details") is not None]
    if any("prompt_tokens_details" in u for u, _ in present):
        merged["prompt_tokens_details"] = details[-1] if details else None
    completion_details = [u["completion_tokens_details"] for u, _ in present
                          if isinstance(u.get("completion_tokens_details"), dict)]
    if completion_details:
        merged["completion_tokens_details"] = _sum_counts(completion_details)
    return merged


def _sum_counts(items: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        for key, value in item.items():
            if isinstance(value, int):
                out[key] = int(out.get(key) or 0) + value
            else:
                out.setdefault(key, value)
    return out


def _reindexed(choices: object, base: int) -> list[Any]:
    if not isinstance(choices, list):
        return []
    out = []
    for choice in choices:
        if isinstance(choice, dict):
            choice = {**choice, "index": base + int(choice.get("index") or 0)}
        out.append(choice)
    return out


def _loads(content: bytes, what: str) -> dict[str, Any]:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise ProxyError(502, f"decode worker sent invalid JSON {what}: {exc}",
                         "decode_failed") from exc
    if not isinstance(data, dict):
        raise ProxyError(502, f"decode worker sent a JSON {what} that is no object",
                         "decode_failed")
    return data


def merge_wholes(parts: Sequence[Part], answers: Sequence[Whole], renames: Renames) -> Whole:
    datas = [_loads(a.content, "answer") for a in answers]
    merged = dict(datas[0])
    merged["id"] = renames.answer_id(0, merged.get("id"))
    merged["choices"] = [
        choice
        for part, data in zip(parts, datas, strict=True)
        for choice in _reindexed(data.get("choices"), part.first_index)
    ]
    usage = merge_usage(
        [(d.get("usage"), part.counts_prompt) for part, d in zip(parts, datas, strict=True)]
    )
    if usage is not None:
        merged["usage"] = usage
    if "metrics" in merged:
        merged["metrics"] = None
    return Whole(orjson.dumps(merged), answers[0].status, answers[0].content_type)


class _Merger:
    """Rewrites one sub-stream's events; holds back usage chunks for the one merged chunk."""

    def __init__(self, parts: Sequence[Part], renames: Renames) -> None:
        self.parts = parts
        self.renames = renames
        self.usages: list[tuple[dict[str, Any] | None, bool]] = [(None, p.counts_prompt)
                                                                  for p in parts]
        self.usage_chunk: tuple[int, dict[str, Any]] | None = None

    def rewrite(self, k: int, block: bytes) -> tuple[bytes, bool]:
        """The block's events for the client, and whether the block ended in an error."""
        out: list[bytes] = []
        for event in block.split(_SEP):
            if not event.strip():
                continue
            if not event.startswith(_DATA + b"{"):
                if event.strip() != DONE_EVENT.strip():
                    out.append(event + _SEP)  # comments (keep-alives) pass as they are
                continue
            try:
                data = orjson.loads(event[len(_DATA):])
            except orjson.JSONDecodeError as exc:
                out.append(error_event(f"decode worker sent an event that is no JSON: {exc}"))
                return b"".join(out), True
            if not isinstance(data, dict) or "error" in data:
                out.append(event + _SEP)
                return b"".join(out), True
            if data.get("choices") == [] and isinstance(data.get("usage"), dict):
                self.usages[k] = (data["usage"], self.parts[k].counts_prompt)
                self.usage_chunk = (k, data)
                continue
            data["id"] = self.renames.answer_id(k, data.get("id"))
            if "choices" in data:
                data["choices"] = _reindexed(data["choices"], self.parts[k].first_index)
            out.append(_DATA + orjson.dumps(data) + _SEP)
        return b"".join(out), False

    def closing(self) -> bytes:
        if self.usage_chunk is None:
            return DONE_EVENT
        k, last = self.usage_chunk
        chunk = {**last, "id": self.renames.answer_id(k, last.get("id")),
                 "usage": merge_usage(self.usages)}
        chunk.pop("metrics", None)
        return _DATA + orjson.dumps(chunk) + _SEP + DONE_EVENT


async def _next(events: AsyncIterator[bytes]) -> bytes:
    return await anext(events)


async def merge_streams(
    parts: Sequence[Part], streams: Sequence[Stream], renames: Renames
) -> AsyncIterator[bytes]:
    """The sub-streams as one; closing them stays with the caller (each ``Stream.close``)."""
    merger = _Merger(parts, renames)
    pending: dict[asyncio.Task[bytes], int] = {}
    try:
        for k, stream in enumerate(streams):
            pending[asyncio.ensure_future(_next(stream.events))] = k
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                k = pending.pop(task)
                try:
                    block = task.result()
                except StopAsyncIteration:
                    continue
                out, failed = merger.rewrite(k, block)
                if failed:
                    yield out + DONE_EVENT
                    return
                if out:
                    yield out
                pending[asyncio.ensure_future(_next(streams[k].events))] = k
        yield merger.closing()
    finally:
        for task in pending:
            task.cancel()
        # Wait for the cancellations, so no sub-stream is still being read when it is closed;
        # shielded, since a client that left cancels this generator over and over.
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*pending, return_exceptions=True)
