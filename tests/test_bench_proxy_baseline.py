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


def os_pythonpath() -> str | None:
    import os

    return os.environ.get("PYTHONPATH")


def test_base_routers_without_a_checkout_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_proxy", "--routers", "eldr-union@base",
                                      "--baseline", str(tmp_path)])
    with pytest.raises(SystemExit, match="need --baseline DIR, an eldr checkout"):
        bench_proxy.main()
