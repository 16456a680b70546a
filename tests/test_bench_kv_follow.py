"""examples/bench_kv_follow.py: eldr's follower applies every batch the bench fakes' publisher
sent (none lost, none undecodable: it exits otherwise) and the bench prints its cost."""

from __future__ import annotations

import sys

import pytest

from examples import bench_kv_follow


def test_the_follower_measures_every_batch_it_was_sent(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench_kv_follow, "WARMUP", 20)
    monkeypatch.setattr(sys, "argv", ["bench_kv_follow", "--modes", "follow", "--rate", "400",
                                      "--batches", "80", "--prompt-tokens", "300"])
    assert bench_kv_follow.main() == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[0] for row in rows] == ["follow"]
    for _, batches, us in rows:
        assert batches == "80" and float(us) > 0
