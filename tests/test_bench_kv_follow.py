"""examples/bench_kv_follow.py: every mode takes the publisher's batches, and eldr's follower
applies all of them (none lost, none undecodable) from the bench fakes' publisher."""

from __future__ import annotations

import sys

import pytest

from examples import bench_kv_follow


def test_every_mode_measures_the_batches_it_was_sent(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench_kv_follow, "WARMUP", 20)
    monkeypatch.setattr(sys, "argv", ["bench_kv_follow", "--rate", "400", "--batches", "80",
                                      "--prompt-tokens", "300"])
    assert bench_kv_follow.main() == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[0] for row in rows] == list(bench_kv_follow.MODES)
    for _, batches, us in rows:
        assert batches == "80" and float(us) > 0
