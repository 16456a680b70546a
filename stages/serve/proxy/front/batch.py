"""Serving a split request: every sub-request through its own prefill and decode, at once.

The first choice of each prompt prefills alone; its other choices prefill once that finished,
as prefix-cache hits on the same prefill worker (the prefix hash sends them there), so ``n``
choices cost about one prompt's compute, as in vLLM. Every sub-request is routed on its own.

Nothing reaches the client before every sub-request has its answer (a stream: its first
event), so each keeps the decode leg's retries, and one that fails fails the whole request
with its error, as vLLM fails a request when one of its prompts does. The others are then
cancelled, which closes their upstream connections and so aborts them on the workers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from anyio.abc import TaskGroup

from stages.serve.proxy.front.batch_merge import Renames, merge_streams, merge_wholes
from stages.serve.proxy.front.batch_split import Part
from stages.serve.proxy.legs.answer import Answer, Stream, Whole
from stages.serve.proxy.legs.context import RequestContext
from stages.serve.proxy.legs.decode import hand_off, run_decode
from stages.serve.proxy.legs.prefill import run_prefill


async def serve_batch(
    subs: Sequence[RequestContext], parts: Sequence[Part], client_id: str
) -> Answer:
    answers: list[Answer | None] = [None] * len(subs)
    failures: list[Exception] = []

    async def decode(k: int, kv: dict[str, Any] | None) -> None:
        answers[k] = await run_decode(subs[k], hand_off(subs[k], kv))

    async def prefill(k: int) -> dict[str, Any] | None:
        # The sequence counts through its lease from here (the leg takes one before it waits).
        subs[k].admission.settle()
        return await run_prefill(subs[k])

    async def whole(k: int) -> None:
        await decode(k, await prefill(k))

    async def prompt(group: TaskGroup, first: int, others: list[int]) -> None:
        kv = await prefill(first)
        group.start_soon(guarded, group, decode, first, kv)
        for k in others:
            group.start_soon(guarded, group, whole, k)

    async def guarded(group: TaskGroup, step: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await step(*args)
        except Exception as exc:
            # Kept as itself (not in the group's ExceptionGroup) for the client's answer.
            failures.append(exc)
            group.cancel_scope.cancel()

    try:
        async with anyio.create_task_group() as group:
            for first, others in _by_prompt(parts):
                group.start_soon(guarded, group, prompt, group, first, others)
    except BaseException:
        await _close(answers)
        raise
    if failures:
        await _close(answers)
        raise failures[0]
    renames = Renames([s.request_id for s in subs], client_id)
    if not subs[0].stream:
        return merge_wholes(parts, [_whole(a) for a in answers], renames)
    streams = [a for a in answers if isinstance(a, Stream)]

    async def close() -> None:
        await _close(streams)

    return Stream(merge_streams(parts, streams, renames), close, streams[0].content_type)


def _whole(answer: Answer | None) -> Whole:
    # A non-streamed decode always answers Whole; anything else is a bug here, not upstream.
    if not isinstance(answer, Whole):
        raise TypeError(f"expected a whole answer, got {answer!r}")
    return answer


def _by_prompt(parts: Sequence[Part]) -> list[tuple[int, list[int]]]:
    """Per prompt: its first sub-request, and the others (its further choices)."""
    groups: dict[int, list[int]] = {}
    for k, part in enumerate(parts):
        groups.setdefault(part.prompt_index, []).append(k)
    return [(ks[0], ks[1:]) for ks in groups.values()]


async def _close(answers: Sequence[Answer | None]) -> None:
    with anyio.CancelScope(shield=True):
        for answer in answers:
            if isinstance(answer, Stream):
                await answer.close()
