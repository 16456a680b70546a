"""The soak's and the schema fuzzing's figures, on made-up samples and replies."""

from __future__ import annotations

import orjson

from examples.soak import Usage, window_growth
from tests.openapi_fuzz import Reply, error_shape_problem


def _reply(status: int, document: object, streamed: bool = False) -> Reply:
    return Reply(status, True, b"" if streamed else orjson.dumps(document), streamed)


def test_vllms_error_shape_passes() -> None:
    error = {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}
    assert error_shape_problem(_reply(400, {"error": error})) is None
    assert error_shape_problem(_reply(400, {"error": {**error, "param": "n"}})) is None


def test_other_error_shapes_are_named() -> None:
    error = {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}
    assert "no error object" in error_shape_problem(_reply(422, {"detail": "bad"}))
    assert "code" in error_shape_problem(_reply(404, {"error": error}))
    assert "message" in error_shape_problem(_reply(400, {"error": {**error, "message": 1}}))
    assert "not JSON" in error_shape_problem(Reply(400, True, b"Bad Request", False))
    assert "event stream" in error_shape_problem(_reply(400, None, streamed=True))


def test_window_takes_the_last_seconds_of_processes_that_lived_through_them() -> None:
    samples = [Usage(at, name, pid, rss, fds) for at, name, pid, rss, fds in (
        (0, "proxy", 1, 100, 50), (0, "decode-0", 2, 1000, 200),
        (500, "proxy", 1, 200, 60), (500, "decode-0", 2, 1000, 200),
        (700, "proxy", 1, 210, 62), (700, "decode-0", 3, 900, 180),  # restarted
        (1100, "proxy", 1, 212, 60), (1100, "decode-0", 3, 905, 180),
    )]
    grown = window_growth(samples, 600)
    assert grown["proxy"]["from_s"] == 500  # not the first sample, before the window
    assert abs(grown["proxy"]["rss_growth"] - 0.06) < 1e-9
    assert grown["proxy"]["fds_range"] == "60-62"
    assert grown["proxy"]["fds_halves"] == "60 -> 61"  # medians of (60) and (62, 60)
    assert "no baseline" in grown["decode-0"]["note"]
