"""A single request's answer reads the client's own id where vLLM wrote eldr's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest

from stages.serve.proxy.legs.answer import Stream, Whole, for_client

OWN = "0123456789abcdef0123456789abcdef"


def test_a_whole_answer_takes_the_clients_id_json_escaped() -> None:
    body = orjson.dumps({"id": f"cmpl-{OWN}", "choices": [{"text": "hi"}]})
    answer = for_client(Whole(body, 200, "application/json"), OWN, 'a "quoted" id')
    assert isinstance(answer, Whole)
    assert orjson.loads(answer.content)["id"] == 'cmpl-a "quoted" id'
    same = Whole(body, 200, "application/json")
    assert for_client(same, OWN, OWN) is same  # no id of the client's: nothing to rename


@pytest.mark.anyio
async def test_a_stream_takes_the_clients_id_in_every_event_and_closes_once() -> None:
    closed: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        for i in range(3):
            yield b"data: " + orjson.dumps({"id": f"chatcmpl-{OWN}", "i": i}) + b"\n\n"

    async def close() -> None:
        closed.append(True)

    answer = for_client(Stream(events(), close, "text/event-stream"), OWN, "mine")
    assert isinstance(answer, Stream)
    blocks = [block async for block in answer.events]
    assert [orjson.loads(b[6:])["id"] for b in blocks] == ["chatcmpl-mine"] * 3
    await answer.close()
    assert closed == [True]

