"""examples/bench_kv_routers.py finds vllm-router where `pip install vllm-router` put it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from examples.bench_kv_routers import find_vllm_router


def test_vllm_router_is_found_beside_the_interpreter_when_path_lacks_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    router = tmp_path / "vllm-router"
    router.write_text("#!/bin/sh\n")
    router.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert find_vllm_router() == str(router)
    router.unlink()
    assert find_vllm_router() is None
