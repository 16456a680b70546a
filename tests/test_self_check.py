"""The serve start-up self-check refuses workers that do not really record signatures."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from stages.errors import EldrError
from stages.serve.proxy import self_check
from stages.signature import wire
from stages.signature.dataset import ModelIdentity

IDENTITY = ModelIdentity("m", 2, 4, 2, (1, 2))


def answer(monkeypatch: pytest.MonkeyPatch, params: dict[str, Any] | None) -> list[dict]:
    sent: list[dict] = []

    def post(url: str, json: dict, headers: dict, timeout: float) -> httpx.Response:
        sent.append({**json, "headers": headers})
        body = {"choices": [{"text": "x"}], "kv_transfer_params": params}
        return httpx.Response(200, json=body, request=httpx.Request("POST", url))

    monkeypatch.setattr(self_check.httpx, "post", post)
    return sent


def test_a_recording_worker_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = answer(monkeypatch, wire.encode(np.full((2, 4), 3, np.int32), (1, 2)))
    self_check.check_records_signatures("http://w", IDENTITY, "m", api_key="k")
    assert sent[0]["model"] == "m" and sent[0]["max_tokens"] == 1
    assert sent[0]["headers"] == {"Authorization": "Bearer k"}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (None, "returns no expert signature"),
        (wire.encode(np.ones((3, 4), np.int32)), "signatures of shape"),
        (wire.encode(np.ones((2, 4), np.int32), (0, 1)), r"built MoE layers \[0, 1\]"),
        (wire.encode(np.zeros((2, 4), np.int32), (1, 2)), "empty expert signature"),
    ],
)
def test_workers_that_would_route_blind_are_refused(
    monkeypatch: pytest.MonkeyPatch, params: dict[str, Any] | None, message: str
) -> None:
    answer(monkeypatch, params)
    with pytest.raises(EldrError, match=message):
        self_check.check_records_signatures("http://w", IDENTITY, "m")


def test_an_unreachable_worker_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def post(url: str, json: dict, headers: dict, timeout: float) -> httpx.Response:
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(self_check.httpx, "post", post)
    with pytest.raises(EldrError, match="self-check of worker http://w failed"):
        self_check.check_records_signatures("http://w", IDENTITY, "m")


def _completion(params: Any) -> bytes:
    return orjson.dumps({"choices": [{"text": "x"}], "kv_transfer_params": params})


@pytest.mark.parametrize(
    ("status", "content", "message"),
    [
        (404, b'{"error": {"message": "model m does not exist"}}', "answered 404: .*does not"),
        (200, b"<html>busy</html>", "its answer is not JSON"),
        (200, b"[1, 2]", "returns no expert signature"),
        (200, _completion("a string"), "returns no expert signature"),
        (200, _completion({wire.SIGNATURE_KEY: "%%%", wire.SHAPE_KEY: [2, 4]}),
         "returns no expert signature"),
        (200, _completion({wire.SIGNATURE_KEY: "AAAA", wire.SHAPE_KEY: "2x4"}),
         "returns no expert signature"),
        (200, _completion(wire.encode(np.zeros((2, 4), np.int32))), "empty expert signature"),
    ],
)
def test_every_malformed_answer_is_one_clear_error(
    status: int, content: bytes, message: str
) -> None:
    # The one judge of an answer, shared by the start-up and the rejoin checks: anything odd
    # is an EldrError with the reason, never another exception.
    with pytest.raises(EldrError, match=message):
        self_check.check_answer("http://w", status, content, IDENTITY)
    good = _completion(wire.encode(np.ones((2, 4), np.int32), (1, 2)))
    self_check.check_answer("http://w", 200, good, IDENTITY)


def test_the_policies_that_need_the_check_come_from_the_registry() -> None:
    from stages.routing.policies import POLICIES, reads_signatures

    readers = {n for n in POLICIES if reads_signatures(n)}
    assert readers == {"eldr", "eldr-bl", "eldr-union"}
    assert all(POLICIES[n].uses_signature or POLICIES[n].uses_counts for n in readers)
