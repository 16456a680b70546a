"""Real vLLM: eldr installed in an environment never stops an engine that does not record, and
an engine that does record refuses, at start and with the reason, what it cannot record right.

eldr's plugin is loaded by every vLLM process of the environment. Here the release check is
made to fail (a ``sitecustomize`` on the servers' PYTHONPATH makes eldr's gate find this
release never run and lacking a touchpoint, in every process vLLM spawns): a plain engine must
still start and serve (the run's plain reference engine, tests.plain_reference, is that
engine), and an engine with eldr's connector must refuse with the touchpoint named.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.engine import ServerSpec, VllmServer
from stages.errors import EldrError
from tests.conftest import free_port, requires_vllm, wait_ready
from tests.plain_reference import MISSING_TOUCHPOINT, untested_release_env

pytestmark = [requires_vllm, pytest.mark.vllm]

@pytest.fixture(scope="module")
def refusing(tiny_model: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    """The engines that must refuse, started together when the module starts: each takes most
    of a minute to reach its refusal, time they spend side by side and beside the plain
    reference engine the first test asks for."""
    from stages.engine import on_cpu

    root = tmp_path_factory.mktemp("guards")
    specs = {"release": ServerSpec(model=str(tiny_model), port=free_port(), role="plain",
                                   enforce_eager=True, extra_env=untested_release_env(root))}
    if on_cpu():  # PP is recorded on GPUs (scripts/gpu-check.sh)
        specs["pp"] = ServerSpec(model=str(tiny_model), port=free_port(), role="plain",
                                 enforce_eager=True, cpu_cores="0|1",
                                 extra_args=("--pipeline-parallel-size", "2"))
    servers = {name: VllmServer(spec, root / name) for name, spec in specs.items()}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def refusal_log(server: VllmServer) -> str:
    """The log of a server that must refuse to start, once it has."""
    with pytest.raises(EldrError, match="exited with code"):
        wait_ready(server, timeout_s=240)
    return server.log_path.read_text(errors="replace")


def test_a_plain_engine_serves_where_eldr_refuses_the_release(
    refusing: dict[str, VllmServer], request: pytest.FixtureRequest
) -> None:
    # The run's plain reference engine (tests.plain_reference) starts in the environment that
    # makes eldr refuse this release. Asked for here, after the refusing engines started, so
    # they boot beside it.
    reference: dict[str, str] = request.getfixturevalue("plain_reference")
    assert reference and all(reference.values()), reference
    # The same environment, the same model, eldr's connector configured: refused at start.
    log = refusal_log(refusing["release"])
    assert f"lacks what eldr's plugin relies on: {MISSING_TOUCHPOINT}" in log


def test_pipeline_parallel_on_cpu_is_refused_at_start_by_name(
    refusing: dict[str, VllmServer]
) -> None:
    if "pp" not in refusing:
        pytest.skip("PP is recorded on GPUs (scripts/gpu-check.sh)")
    log = refusal_log(refusing["pp"])
    assert "eldr cannot record expert signatures with pipeline parallel" in log
