"""NIXL's progress thread is off in the CPU workers eldr starts, and only there."""

from __future__ import annotations

import pytest

from tests.conftest import requires_vllm


@requires_vllm
def test_the_agent_config_vllm_builds_has_no_progress_thread_when_asked(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.distributed.nixl_utils as nixl_utils

    from stages.capture.nixl_progress import ENV, apply_progress_thread_choice

    original = nixl_utils.nixl_agent_config
    if original is None:
        pytest.skip("NIXL is not installed")
    monkeypatch.setattr(nixl_utils, "nixl_agent_config", original)
    monkeypatch.delenv(ENV, raising=False)
    assert not apply_progress_thread_choice()  # any other engine keeps NIXL's default
    assert original(num_threads=4).enable_pthread
    monkeypatch.setenv(ENV, "0")
    assert apply_progress_thread_choice()
    config = nixl_utils.nixl_agent_config(num_threads=4, capture_telemetry=True)
    assert not config.enable_pthread and config.num_threads == 4  # the rest as vLLM asked
    assert not apply_progress_thread_choice()  # once


def test_cpu_workers_are_started_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import stages.engine as engine
    from stages.capture.nixl_progress import ENV

    spec = engine.ServerSpec(model="/m", port=1, role="decode")
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(engine, "on_cpu", lambda: True)
    assert engine.server_command(spec)[1][ENV] == "0"
    monkeypatch.setattr(engine, "on_cpu", lambda: False)
    assert ENV not in engine.server_command(spec)[1]
