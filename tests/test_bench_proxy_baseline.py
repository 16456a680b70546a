"""examples/bench_proxy.py's --baseline: NAME@base runs router NAME from another checkout, beside
this one's, on the same fakes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from examples import bench_proxy


def test_router_names_take_base_only_for_eldr_routers() -> None:
    assert bench_proxy.router_name("eldr-kv@base") == "eldr-kv@base"
    assert bench_proxy.router_name("eldr-union") == "eldr-union"
    for bad in ("vllm-router@base", "direct@base", "eldr-kv@old", "nope"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_proxy.router_name(bad)
    assert bench_proxy.kv_aware("eldr-kv@base") and not bench_proxy.kv_aware("eldr-union@base")
    assert bench_proxy.subscribes("eldr-union-rec@base")


def test_a_base_router_starts_from_the_baseline_checkout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[dict[str, Any]] = []

    def popen(argv: list[str], **kwargs: Any) -> object:
        started.append({"argv": argv, **kwargs})
        return object()

    monkeypatch.setattr(subprocess, "Popen", popen)
    base = tmp_path / "base"
    args = (1234, ["http://p"], ["http://d"], [], ["tcp://e1", "tcp://e2"], tmp_path)
    bench_proxy.start_router("eldr-kv@base", *args, baseline=base)
    bench_proxy.start_router("eldr-kv", *args, baseline=base)
    old, new = started
    assert old["cwd"] == base and old["env"]["PYTHONPATH"] == str(base)
    assert new["cwd"] is None and new["env"].get("PYTHONPATH") == os_pythonpath()
    # The same command either way: the policy's own name, its KV events attached.
    assert old["argv"] == new["argv"]
    assert old["argv"][old["argv"].index("--policy") + 1] == "eldr-kv"
    assert "--attach-kv-events" in old["argv"]
    # A base router records and logs apart from the same router of this checkout.
    recording = (1234, ["http://p"], ["http://d"], ["tcp://b"], [], tmp_path)
    bench_proxy.start_router("eldr-union-rec@base", *recording, baseline=base)
    bench_proxy.start_router("eldr-union-rec", *recording, baseline=base)
    old_rec, new_rec = (run["argv"][run["argv"].index("--record-to") + 1]
                        for run in started[2:])
    assert old_rec != new_rec
    assert (tmp_path / "eldr-union-rec@base.log").exists()


def os_pythonpath() -> str | None:
    import os

    return os.environ.get("PYTHONPATH")


def test_base_routers_without_a_checkout_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_proxy", "--routers", "eldr-union@base",
                                      "--baseline", str(tmp_path)])
    with pytest.raises(SystemExit, match="need --baseline DIR, an eldr checkout"):
        bench_proxy.main()


def test_the_summary_gives_medians_over_rounds_and_capacity_over_the_first_router() -> None:
    def point(router: str, cpu_s: float, round_: int) -> bench_proxy.Point:
        return bench_proxy.Point(router, "plain", 64, 8.0, 1000, 0, 1000, 1.0, 2.0, cpu_s, 1.0,
                                 round=round_)

    points = [point("eldr-union@base", cpu, r) for r, cpu in enumerate((0.6, 0.7, 0.9))]
    points += [point("eldr-kv", cpu, r) for r, cpu in enumerate((0.9, 1.4, 1.0))]
    rows = {line.split()[2]: line.split() for line in
            bench_proxy.summary(points, "eldr-union@base").splitlines()[1:]}
    # Medians 0.7 and 1.0 ms a request: eldr-kv relays 0.7 of the reference's requests per
    # CPU-second.
    assert rows["eldr-union@base"][3:6] == ["3", "0.700", "(0.60-0.90)"]
    assert rows["eldr-kv"][3:7] == ["3", "1.000", "(0.90-1.40)", "0.70"]
    assert rows["eldr-union@base"][6] == "1.00"
