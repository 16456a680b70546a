"""The serve start-up self-check refuses workers that do not really record signatures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from stages.errors import EldrError
from stages.serve.proxy.client.http1 import Headers
from stages.serve.proxy.client.upstream import Reply
from stages.serve.proxy.ops import self_check
from stages.signature import wire
from stages.signature.dataset import ModelIdentity

IDENTITY = ModelIdentity("m", 2, 4, 2, (1, 2))


def answer(monkeypatch: pytest.MonkeyPatch, params: dict[str, Any] | None) -> list[dict]:
    sent: list[dict] = []

    def fetch(method: str, url: str, path: str, headers: dict, timeout_s: float,
              body: bytes = b"") -> Reply:
        assert (method, path) == ("POST", "/v1/completions")
        sent.append({**orjson.loads(body), "headers": headers})
        answer = {"choices": [{"text": "x"}], "kv_transfer_params": params}
        return Reply(200, Headers([]), orjson.dumps(answer))

    monkeypatch.setattr(self_check, "fetch_blocking", fetch)
    return sent


def test_a_recording_worker_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = answer(monkeypatch, wire.encode(np.full((2, 4), 3, np.int32), (1, 2)))
    self_check.check_records_signatures("http://w", IDENTITY, "m", api_key="k")
    assert sent[0]["model"] == "m" and sent[0]["max_tokens"] == 1
    assert sent[0]["headers"] == {"Authorization": "Bearer k", "Content-Type": "application/json"}


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
    with pytest.raises(EldrError, match=r"self-check of worker http://127\.0\.0\.1:9 failed"):
        self_check.check_records_signatures("http://127.0.0.1:9", IDENTITY, "m", timeout_s=2.0)


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
    assert readers == {"eldr", "eldr-bl", "eldr-union", "eldr-kv"}
    assert all(POLICIES[n].uses_signature or POLICIES[n].uses_counts for n in readers)


def test_attached_workers_are_checked_under_the_name_they_serve(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Workers started as `eldr worker-args` says but served under their path (vLLM's
    default name): the self-check asks for the model by the name their /v1/models lists, and
    the proxy forwards under it; workers that disagree are refused, both names given."""
    from typer.testing import CliRunner

    from eldr_cli.app import app
    from tests.conftest import free_port
    from tests.test_cli import _Serving

    serving = _Serving(monkeypatch, tmp_path, ["p0", "d0", "d1"])
    try:
        for behavior in serving.behaviors:
            behavior.served_name = "/models/tiny"
        attach = ["--attach-prefill", serving.urls[0], "--attach-decode", serving.urls[1],
                  "--attach-decode", serving.urls[2]]
        ok = CliRunner().invoke(app, ["serve", "--policy", "rr", "--port", str(free_port()),
                                      *attach])
        assert ok.exit_code == 0, ok.output
        assert serving.checked() == ["p0", "d0", "d1"]
        (config,) = serving.configs
        assert config.model == "/models/tiny"  # type: ignore[attr-defined]

        named = CliRunner().invoke(app, ["serve", "--policy", "rr", "--port", str(free_port()),
                                         "--served-model-name", "tiny", *attach])
        assert isinstance(named.exception, EldrError)
        assert "'/models/tiny'" in str(named.exception) and "'tiny'" in str(named.exception)

        serving.behaviors[2].served_name = "other"
        refused = CliRunner().invoke(app, ["serve", "--policy", "rr", "--port",
                                           str(free_port()), *attach])
        assert isinstance(refused.exception, EldrError)
        message = str(refused.exception)
        assert serving.urls[2] in message and "'other'" in message
        assert "'/models/tiny'" in message
        assert len(serving.configs) == 1  # the proxy never opened
    finally:
        serving.stop()
