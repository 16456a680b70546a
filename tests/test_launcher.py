"""Core pinning and worker specs of the launcher (no processes started)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stages.engine import ServerSpec
from stages.errors import EldrError
from stages.serve.cluster.launcher import core_plan


def test_two_cores_keep_prefill_and_decode_apart() -> None:
    assert core_plan(["prefill", "decode", "decode"], [0, 1]) == ["0", "1", "1"]


def test_enough_cores_give_disjoint_ranges() -> None:
    plan = core_plan(["prefill", "decode", "decode"], list(range(12)))
    assert plan == ["0-3", "4-7", "8-11"]


def test_one_core_is_shared() -> None:
    assert core_plan(["prefill", "decode"], [0]) == ["0", "0"]


def test_no_cores_known_lets_vllm_decide() -> None:
    assert core_plan(["prefill", "decode"], []) == [None, None]


def test_prefill_variant_runs_on_prefill_workers_only() -> None:
    from stages.engine import kv_transfer_config
    from stages.serve.cluster.launcher import ClusterSpec, worker_specs

    spec = ClusterSpec(model="/m/wide", served_name="w", prefill_model="/m/narrow")
    specs = worker_specs(spec, [5600, 5601, 5602])
    assert [(s.role, s.model) for s in specs] == [
        ("prefill", "/m/narrow"), ("decode", "/m/wide"), ("decode", "/m/wide")
    ]
    # NIXL's handshake hash covers the model path, so eldr's own check replaces it.
    assert not any(s.nixl_compat_check for s in specs)
    nixl = kv_transfer_config("decode", nixl_compat_check=False)["kv_connector_extra_config"]
    assert nixl["connectors"][1]["kv_connector_extra_config"] == {  # type: ignore[index]
        "enforce_handshake_compat": False
    }


def test_same_model_keeps_nixl_handshake_check() -> None:
    from stages.engine import kv_transfer_config
    from stages.serve.cluster.launcher import ClusterSpec, worker_specs

    spec = ClusterSpec(model="/m/a", served_name="a", prefill_model="/m/a")
    specs = worker_specs(spec, [1, 2, 3])
    assert all(s.nixl_compat_check and s.model == "/m/a" for s in specs)
    nixl = kv_transfer_config("prefill")["kv_connector_extra_config"]["connectors"][1]  # type: ignore[index]
    assert "kv_connector_extra_config" not in nixl


def test_explicit_worker_cores_replace_the_plan() -> None:
    import os

    from stages.serve.cluster.launcher import ClusterSpec, worker_specs

    core = str(min(os.sched_getaffinity(0)))
    spec = ClusterSpec(model="/m", served_name="m", worker_cores=(core,) * 3)
    specs = worker_specs(spec, [1, 2, 3])
    assert [s.cpu_cores for s in specs] == [core] * 3


def test_bad_worker_cores_are_user_errors() -> None:
    import pytest

    from stages.errors import EldrError
    from stages.serve.cluster.launcher import check_worker_cores

    with pytest.raises(EldrError, match="3 core sets for 2 workers"):
        check_worker_cores(("0", "0", "0"), 2)
    with pytest.raises(EldrError, match="not a core list"):
        check_worker_cores(("x",), 1)
    with pytest.raises(EldrError, match="may not use"):
        check_worker_cores(("100000",), 1)
    from stages.serve.cluster.launcher import ClusterSpec

    with pytest.raises(EldrError, match="1 core sets for 3 workers"):  # checked on creation
        ClusterSpec(model="/m", served_name="m", worker_cores=("0",))


def test_gpu_workers_get_one_device_each_and_share_memory_when_they_must() -> None:
    from stages.serve.cluster.launcher import gpu_plan

    assert gpu_plan([1, 1, 1], 4) == [((0,), 0.9), ((1,), 0.9), ((2,), 0.9)]
    assert gpu_plan([1, 1, 1], 1) == [((0,), 0.3), ((0,), 0.3), ((0,), 0.3)]
    assert gpu_plan([1, 1, 1], 2) == [((0,), 0.45), ((1,), 0.45), ((0,), 0.45)]
    # Tensor-parallel workers take several GPUs each.
    assert gpu_plan([1, 2, 2], 8) == [((0,), 0.9), ((1, 2), 0.9), ((3, 4), 0.9)]
    assert gpu_plan([2, 2], 2) == [((0, 1), 0.45), ((0, 1), 0.45)]
    with pytest.raises(EldrError, match="tensor parallel size 4 needs that many GPUs"):
        gpu_plan([4], 2)


def test_gpu_worker_command_names_its_device(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from stages.engine import ServerSpec, server_command

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    argv, env = server_command(ServerSpec(model="m", port=1, gpus=(1,),
                                          gpu_memory_utilization=0.45))
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.45"
    assert "--enforce-eager" not in argv  # vLLM's default compiled mode
    argv, env = server_command(ServerSpec(model="m", port=1, gpus=(0, 1),
                                          tensor_parallel_size=2))
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"


def free_range(count: int) -> int:
    """A first port with ``count`` free ports from it (ports near an ephemeral one may not be)."""
    from stages.serve.cluster.ports import check_free
    from tests.conftest import free_port

    for _ in range(100):
        base = free_port()
        try:
            check_free("test", range(base, base + count))
        except EldrError:
            continue
        return base
    raise AssertionError(f"no {count} free ports in a row")


def test_cluster_knows_its_urls_and_free_side_channel_ports_before_starting() -> None:
    from stages.serve.cluster.launcher import Cluster, ClusterSpec

    base = free_range(3)
    cluster = Cluster(ClusterSpec(model="/m", served_name="m", base_port=base))
    assert cluster.prefill_urls == [f"http://127.0.0.1:{base}"]
    assert cluster.decode_urls == [f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 2}"]
    assert cluster.servers == []  # nothing started
    nixl = [s.nixl_side_channel_port for s in cluster.specs]
    # Chosen free, distinct, and none of them a worker's HTTP port: a second deployment on
    # the host gets other ones.
    assert len(set(nixl)) == 3 and not set(nixl) & {base, base + 1, base + 2}
    other = Cluster(ClusterSpec(model="/m", served_name="m", base_port=base))
    assert [s.port for s in other.specs] == [s.port for s in cluster.specs]


def test_ports_in_use_or_overlapping_are_refused_before_anything_starts() -> None:
    import socket

    import pytest

    from stages.errors import EldrError
    from stages.serve.cluster.launcher import Cluster, ClusterSpec

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.raises(EldrError, match=f"--worker-port: port {taken} on 127.0.0.1 is not"):
            Cluster(ClusterSpec(model="/m", served_name="m", base_port=taken))
        with pytest.raises(EldrError, match=f"--nixl-port: port {taken} on 127.0.0.1 is not"):
            Cluster(ClusterSpec(model="/m", served_name="m", base_port=free_range(3),
                                nixl_base_port=taken))
    base = free_range(13)
    with pytest.raises(EldrError, match="also worker HTTP ports"):
        Cluster(ClusterSpec(model="/m", served_name="m", base_port=base, nixl_base_port=base + 2))
    cluster = Cluster(ClusterSpec(model="/m", served_name="m", base_port=base,
                                  nixl_base_port=base + 10))
    assert [s.nixl_side_channel_port for s in cluster.specs] == [base + 10, base + 11, base + 12]


def test_started_workers_keep_nixl_and_vllm_sockets_on_loopback() -> None:
    from stages.engine import ServerSpec, server_command

    _, env = server_command(ServerSpec(model="m", port=1, role="decode",
                                       nixl_side_channel_port=7000))
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "7000"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_HOST_IP"] == env["VLLM_LOOPBACK_IP"] == "127.0.0.1"
    assert env["UCX_NET_DEVICES"] == "lo"


def test_a_restarted_worker_keeps_its_spec_and_its_log(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import sys
    import time
    from pathlib import Path

    import stages.engine as engine
    from stages.serve.cluster.launcher import Cluster, ClusterSpec
    from tests.proc_probe import alive, tree

    def command(spec: engine.ServerSpec) -> tuple[list[str], dict[str, str]]:
        # A stand-in server: says which port it has, then waits to be killed.
        code = f"print('up on {spec.port}', flush=True); import time; time.sleep(60)"
        return [sys.executable, "-c", code], {}

    monkeypatch.setattr(engine, "server_command", command)
    cluster = Cluster(ClusterSpec(model="/m", served_name="m", prefill=1, decode=1,
                                  base_port=free_range(2), log_dir=tmp_path))
    for spec in cluster.specs:
        cluster.servers.append(engine.VllmServer(spec, tmp_path))
    def wait_for_lines(path: Path, count: int) -> None:
        deadline = time.monotonic() + 20
        while path.read_text().count("up on") < count:
            assert time.monotonic() < deadline, path.read_text()
            time.sleep(0.05)

    try:
        old = cluster.servers[1]
        wait_for_lines(old.log_path, 1)
        first = tree(old.proc.pid)
        assert old.exit_code() is None and not old.engine_dead()
        new = cluster.restart(1)
        assert new is cluster.servers[1] and new.spec == old.spec
        assert old.exit_code() is not None and not any(alive(p) for p in first)
        assert new.log_path == old.log_path
        wait_for_lines(new.log_path, 2)  # the restart appended to the crashed run's log
    finally:
        cluster.stop()


def test_free_ports_stay_below_the_kernels_ephemeral_range() -> None:
    from stages.serve.cluster.ports import _ephemeral_low, free_ports

    ports = free_ports(8, avoid=range(10000, 10100))
    # Ephemeral ports go to any socket's automatic bind (vLLM's ZMQ and gloo ones among them),
    # so a port picked there could be taken before the worker binds it.
    assert len(set(ports)) == 8 and all(10100 <= p < _ephemeral_low() for p in ports)


def test_tensor_parallel_workers_bind_one_core_group_per_rank() -> None:
    from stages.engine import rank_binding

    assert rank_binding([0, 1], 2, [0, 1]) == "0|1"
    assert rank_binding([2, 3, 4, 5], 2, [0, 1, 2, 3, 4, 5]) == "2-3|4-5"
    # A worker with fewer cores than ranks stacks them, leaving other workers' cores alone.
    assert rank_binding([1], 2, [0, 1]) == "1|1"
    assert rank_binding([], 2, [0, 1]) == "0|1"
    assert rank_binding([0, 1], 4, [0, 1]) == "0|1|0|1"


def test_cluster_gives_its_tensor_parallel_decode_worker_a_core_per_rank(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import stages.serve.cluster.launcher as launcher

    monkeypatch.setattr(launcher, "on_cpu", lambda: True)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1})
    spec = launcher.ClusterSpec(model="/m", served_name="m", prefill=1, decode=1, decode_tp=2)
    prefill, decode = launcher.worker_specs(spec, [1, 2])
    assert (prefill.cpu_cores, prefill.tensor_parallel_size) == ("0", 1)
    assert (decode.cpu_cores, decode.tensor_parallel_size) == ("1|1", 2)


def test_compiled_cpu_workers_of_one_configuration_wait_for_the_first() -> None:
    from stages.serve.cluster.launcher import compile_leaders

    prefill = ServerSpec(model="/small", port=1, role="prefill")
    decode = ServerSpec(model="/wide", port=2, role="decode")
    specs = [prefill, decode, replace(decode, port=3), replace(decode, port=4)]
    # The prefill worker and the first decode worker start at once; the other decode workers
    # wait for the first one's compile cache.
    assert compile_leaders(specs, cpu=True) == [None, None, 1, 1]
    assert compile_leaders(specs, cpu=False) == [None] * 4  # GPUs: each compiles on its own
    eager = [replace(s, enforce_eager=True) for s in specs]
    assert compile_leaders(eager, cpu=True) == [None] * 4  # nothing to compile
    other = [decode, replace(decode, port=3, max_num_seqs=16)]
    assert compile_leaders(other, cpu=True) == [None, None]  # other graphs


def test_a_follower_starts_once_its_leader_is_ready(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import sys

    import stages.engine as engine
    import stages.serve.cluster.launcher as launcher

    marks = tmp_path / "marks"
    marks.mkdir()
    ports = free_range(3)
    prefill, first, second = ports, ports + 1, ports + 2
    # Stand-in servers that order themselves by marker files, not by clocks (a loaded machine
    # may take seconds to start Python): each leaves "started-PORT"; prefill and the first
    # decode worker answer /health only once the other has started, so a launcher that made
    # either wait for the other to be up never gets both up; the follower notes whether its
    # leader was up when it started.
    waits = {prefill: first, first: prefill}

    def command(spec: engine.ServerSpec) -> tuple[list[str], dict[str, str]]:
        other = waits.get(spec.port)
        code = (
            "import http.server, pathlib, time\n"
            f"m = pathlib.Path({str(marks)!r})\n"
            f"leader_up = (m / 'up-{first}').exists()\n"
            f"(m / 'started-{spec.port}').write_text(str(leader_up))\n"
            f"while {other is not None} and not (m / 'started-{other}').exists():\n"
            "    time.sleep(0.05)\n"
            f"(m / 'up-{spec.port}').touch()\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers()\n"
            "    def log_message(self, *a): pass\n"
            f"http.server.HTTPServer(('127.0.0.1', {spec.port}), H).serve_forever()\n"
        )
        return [sys.executable, "-c", code], {}

    monkeypatch.setattr(engine, "server_command", command)
    monkeypatch.setattr(launcher, "on_cpu", lambda: True)
    cluster = launcher.Cluster(launcher.ClusterSpec(
        model="/m", served_name="m", prefill=1, decode=2, base_port=prefill, log_dir=tmp_path))
    ready: list[int] = []
    try:
        cluster.start(on_ready=lambda server: ready.append(server.spec.port), timeout_s=60)
    finally:
        cluster.stop()
    assert [s.spec for s in cluster.servers] == cluster.specs
    assert [s.port for s in cluster.specs] == [prefill, first, second]
    assert ready[-1] == second  # the follower is ready last
    # Both up: neither of prefill and the first decode worker waited for the other. The
    # follower started only once its leader was up.
    assert (marks / f"started-{second}").read_text() == "True"
