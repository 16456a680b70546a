"""examples/bench_kv_routers.py finds vllm-router where `pip install vllm-router` put it, and
prices eldr's policies with the measured engine cost."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from examples.bench_kv_routers import _priced_by, find_vllm_router


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


def test_the_measured_cost_prices_every_policy_that_takes_one_and_overrides_no_user_choice(
        ) -> None:
    cost = Path("/tmp/cost-model.json")
    config = json.loads(_priced_by(
        cost, '{"eldr-union": {"cost": "cpu"}, "eldr-kv": {"load_slack": 0.5}}',
        "eldr-kv,eldr-union,eldr,jsq", ['arrival=kv:{"decode_choice": "arrival"}']))
    # The user's own cost stays; eldr (the paper's rule) and jsq take none.
    assert config == {"eldr-kv": {"load_slack": 0.5, "cost": str(cost)},
                      "eldr-union": {"cost": "cpu"}, "kv": {"cost": str(cost)}}


def test_engine_cost_without_an_artifact_says_how_to_get_one(tmp_path: Path) -> None:
    from examples.bench_kv_routers import _engine_cost

    with pytest.raises(SystemExit, match="--capture N, or --home"):
        _engine_cost(["eldr"], {}, tmp_path, "http://127.0.0.1:1")
    (tmp_path / "cost-model.json").write_text("{}")  # measured before: reused, nothing run
    assert _engine_cost(["eldr"], {}, tmp_path, "http://127.0.0.1:1") == (
        tmp_path / "cost-model.json")


def test_vllm_router_policies_per_leg_and_kv_aware_refused_with_the_reason() -> None:
    from examples.bench_kv_routers import _vllm_router_policies

    assert _vllm_router_policies("cache_aware", None) == ["--policy", "cache_aware"]
    assert _vllm_router_policies("cache_aware", "power_of_two") == [
        "--policy", "cache_aware", "--decode-policy", "power_of_two"]
    with pytest.raises(SystemExit, match="its regular mode only"):
        _vllm_router_policies("cache_aware", "kv_aware")
