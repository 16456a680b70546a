"""The serve start-up self-check refuses workers that do not really record signatures."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from stages.errors import EldrError
from stages.serve import self_check
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
