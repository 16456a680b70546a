"""Start the vLLM prefill/decode workers `eldr serve` fronts, and stop all of them.

Workers are real vLLM OpenAI servers with eldr's connector composed with NixlConnector. On CPU,
each worker gets its own cores when there are enough, otherwise workers are spread over the
cores round-robin (oversubscribing a core with two OpenMP teams is far slower than sharing).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stages.engine import ServerSpec, VllmServer, on_cpu, parse_cores, rank_binding
from stages.errors import EldrError
from stages.serve.cluster.ports import check_free, free_ports


@dataclass(frozen=True)
class ClusterSpec:
    model: str  # vLLM --model: local directory or hub id
    served_name: str
    # A routing-identical variant to prefill on (e.g. tiny for tiny-wide); None: ``model``.
    prefill_model: str | None = None
    prefill: int = 1
    decode: int = 2
    base_port: int = 8100
    # First NIXL side-channel port (one per worker, in order); None: ports the system reports
    # free, so two deployments on one host never share one.
    nixl_base_port: int | None = None
    max_model_len: int = 1024
    max_num_seqs: int = 8
    kv_cache_gib: int = 1
    log_dir: Path = Path(".eldr/logs")
    # Explicit cores per worker (prefill workers first), e.g. ("0", "0", "1"); None: core_plan.
    worker_cores: tuple[str, ...] | None = None
    enforce_eager: bool = False
    extra_args: tuple[str, ...] = ()
    # vLLM --tensor-parallel-size of each prefill / decode worker
    prefill_tp: int = 1
    decode_tp: int = 1
    # Workers publish each stored KV block's expert counts (stages.capture.expert_events).
    expert_events: bool = False

    def tp(self, role: str) -> int:
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def __post_init__(self) -> None:
        if self.worker_cores is not None:
            check_worker_cores(self.worker_cores, self.prefill + self.decode)


def core_plan(roles: list[str], cores: list[int]) -> list[str | None]:
    """OMP core binding per server (VLLM_CPU_OMP_THREADS_BIND values), in ``roles`` order.

    Prefill and decode workers get separate core pools in proportion to their numbers, so
    decode workers are never slowed unevenly by sharing a core with a prefill worker; inside a
    pool, servers get disjoint core ranges, or share cores round-robin when there are too few.
    """
    if not cores:
        return [None] * len(roles)
    num_prefill = roles.count("prefill")
    if 0 < num_prefill < len(roles) and len(cores) > 1:
        prefill_cores = max(1, min(len(cores) - 1, round(len(cores) * num_prefill / len(roles))))
        pools = {"prefill": cores[:prefill_cores], "decode": cores[prefill_cores:]}
    else:
        pools = {"prefill": cores, "decode": cores}
    plan: list[str | None] = [None] * len(roles)
    for role, pool in pools.items():
        members = [i for i, r in enumerate(roles) if r == role]
        for slot, server in enumerate(members):
            if len(pool) >= len(members):
                share = len(pool) // len(members)
                chunk = pool[slot * share : (slot + 1) * share]
            else:
                chunk = [pool[slot % len(pool)]]
            plan[server] = f"{chunk[0]}-{chunk[-1]}" if len(chunk) > 1 else str(chunk[0])
    return plan


def shared_compute(devices: list[frozenset[int]]) -> tuple[int, ...]:
    """A group per worker from the devices it runs on (its bound cores, or its GPUs): workers
    whose devices overlap, directly or through others, share one group; a worker with none
    (unbound) has a group of its own. A group's workers take turns on the same silicon, so a
    queue on one delays the others."""
    group = list(range(len(devices)))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for i, mine in enumerate(devices):
        for j in range(i):
            if mine & devices[j]:
                group[root(i)] = root(j)
    roots: dict[int, int] = {}
    return tuple(roots.setdefault(root(i), len(roots)) for i in range(len(devices)))


def compute_groups(specs: list[ServerSpec], role: str) -> tuple[int, ...]:
    """``shared_compute`` of ``role``'s workers: on CPU their bound cores (every rank's), on
    GPUs their devices (``core_plan`` and ``gpu_plan`` put several workers on one when
    short)."""
    return shared_compute([
        frozenset(core for ranks in (s.cpu_cores or "").split("|") if ranks
                  for core in parse_cores(ranks)) or frozenset(s.gpus)
        for s in specs if s.role == role])


def gpu_plan(sizes: list[int], num_gpus: int) -> list[tuple[tuple[int, ...], float]]:
    """(GPU indices, --gpu-memory-utilization) per worker, ``sizes`` being each worker's
    tensor-parallel size: workers take the next GPUs in turn, wrapping round, and workers
    sharing a GPU split vLLM's default 0.9 of its memory between them."""
    if num_gpus < 1:
        raise EldrError("no GPU is visible (CUDA_VISIBLE_DEVICES?), but vLLM's GPU build is"
                        " installed; on a CPU machine install the cpu extra")
    if max(sizes, default=1) > num_gpus:
        raise EldrError(f"a worker with tensor parallel size {max(sizes)} needs that many GPUs;"
                        f" {num_gpus} are visible")
    devices: list[tuple[int, ...]] = []
    taken = 0
    for size in sizes:
        devices.append(tuple((taken + rank) % num_gpus for rank in range(size)))
        taken += size
    sharing = -(-taken // num_gpus)
    share = round(0.9 / sharing, 2)
    return [(gpus, share) for gpus in devices]


def visible_gpus() -> int:
    import torch

    return int(torch.cuda.device_count())


def check_worker_cores(worker_cores: tuple[str, ...], num_workers: int) -> None:
    """Validate an explicit per-worker core list against this process's allowed cores."""
    if len(worker_cores) != num_workers:
        raise EldrError(
            f"--worker-cores lists {len(worker_cores)} core sets for {num_workers} workers"
            " (prefill workers first, then decode workers)"
        )
    allowed = os.sched_getaffinity(0)
    for text in worker_cores:
        try:
            cores = parse_cores(text)
        except ValueError:
            raise EldrError(
                f"--worker-cores: {text!r} is not a core list like 0, 2-3 or 0,2"
            ) from None
        missing = sorted(set(cores) - allowed)
        if not cores or missing:
            raise EldrError(
                f"--worker-cores: {text!r} names cores {missing} this process may not use"
                f" (allowed: {sorted(allowed)})"
            )


def worker_ports(spec: ClusterSpec) -> list[int]:
    return [spec.base_port + i for i in range(spec.prefill + spec.decode)]


def side_channel_ports(spec: ClusterSpec) -> list[int]:
    """NIXL side-channel port per worker: the given range, checked free, or free ones."""
    http = worker_ports(spec)
    if spec.nixl_base_port is None:
        return free_ports(len(http), avoid=http)
    nixl = [spec.nixl_base_port + i for i in range(len(http))]
    overlap = sorted(set(nixl) & set(http))
    if overlap:
        raise EldrError(
            f"--nixl-port {spec.nixl_base_port}: ports {overlap} are also worker HTTP ports"
            f" (--worker-port {spec.base_port}); the {len(http)} workers use"
            f" {http[0]}-{http[-1]}"
        )
    check_free("--nixl-port", nixl)
    return nixl


def worker_specs(spec: ClusterSpec, nixl_ports: list[int],
                 batch_ports: list[int] | None = None,
                 kv_events: list[str] | None = None,
                 expert_events: list[str] | None = None) -> list[ServerSpec]:
    """The workers' specs, prefill workers first; ``nixl_ports`` has one port per worker,
    ``batch_ports`` one per decode worker (None: they publish no batch), ``kv_events`` one
    KV event endpoint per worker (None: they publish no KV events)."""
    roles = ["prefill"] * spec.prefill + ["decode"] * spec.decode
    allowed = sorted(os.sched_getaffinity(0)) if on_cpu() else []
    if spec.worker_cores is not None:
        binding: list[str | None] = list(spec.worker_cores)
    else:
        binding = core_plan(roles, allowed)
    for i, role in enumerate(roles):
        if allowed and spec.tp(role) > 1:
            # One core group per rank, as vLLM's CPU build needs ("0|1").
            own = parse_cores(binding[i]) if binding[i] else []
            binding[i] = rank_binding(own, spec.tp(role), allowed)
    # On GPUs each worker sees its own devices; workers sharing one split its memory.
    gpus = None if on_cpu() else gpu_plan([spec.tp(r) for r in roles], visible_gpus())
    mixed = spec.prefill_model is not None and spec.prefill_model != spec.model
    return [
        ServerSpec(
            model=spec.prefill_model if mixed and role == "prefill" else spec.model,
            port=spec.base_port + i,
            role=role,
            served_name=spec.served_name,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            kv_cache_gib=spec.kv_cache_gib,
            cpu_cores=binding[i],
            nixl_side_channel_port=nixl_ports[i],
            batch_port=batch_ports[i - spec.prefill] if batch_ports and role == "decode" else None,
            kv_events=kv_events[i] if kv_events else None,
            expert_events=expert_events[i] if expert_events else None,
            nixl_compat_check=not mixed,
            enforce_eager=spec.enforce_eager,
            tensor_parallel_size=spec.tp(role),
            gpus=gpus[i][0] if gpus else (),
            gpu_memory_utilization=gpus[i][1] if gpus else None,
            extra_args=spec.extra_args,
        )
        for i, role in enumerate(roles)
    ]


def compile_leaders(specs: list[ServerSpec], cpu: bool) -> list[int | None]:
    """For each worker, the earlier worker whose readiness it waits for before starting (None:
    it starts at once).

    On CPU, compiled workers with the same engine configuration compile the same graphs on the
    same few cores: started together, each compiles them all (three such workers took 4 min 42
    s on 2 cores). The first compiles and fills vLLM's compile cache; the others start once it
    is ready and load from it. On GPUs each worker compiles on its own cores, so all start at
    once.
    """
    if not cpu:
        return [None] * len(specs)
    first: dict[tuple[object, ...], int] = {}
    leaders: list[int | None] = []
    for i, s in enumerate(specs):
        if s.enforce_eager:
            leaders.append(None)
            continue
        key = (s.model, s.role, s.max_model_len, s.max_num_seqs, s.kv_cache_gib,
               s.tensor_parallel_size, s.enable_prefix_caching, s.extra_args)
        leaders.append(first.get(key))
        first.setdefault(key, i)
    return leaders


class Cluster:
    """The started workers. Use as a context manager: leaving it stops every process.

    The specs are fixed on creation (ports checked or chosen there), so the URLs are known
    before anything starts, and a restarted worker comes back on the same ports.
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        check_free("--worker-port", worker_ports(spec))
        nixl = side_channel_ports(spec)
        batch = free_ports(spec.decode, avoid=[*worker_ports(spec), *nixl])
        # KV events on ipc sockets: bound, yet reachable from this host only (vLLM binds a tcp
        # endpoint only as a wildcard, on every interface).
        self._kv_dir = Path(tempfile.mkdtemp(prefix="eldr-kv-"))
        kv = [f"ipc://{self._kv_dir}/{i}" for i in range(spec.prefill + spec.decode)]
        experts = [f"ipc://{self._kv_dir}/experts-{i}" for i in range(len(kv))]
        self.specs = worker_specs(spec, nixl, batch, kv, experts if spec.expert_events else None)
        self.servers: list[VllmServer] = []  # in spec order, once all are ready
        self._starting: dict[int, VllmServer] = {}  # spec index -> started, while starting

    def start(
        self, on_ready: Callable[[VllmServer], None] | None = None, timeout_s: float = 600.0
    ) -> None:
        waits_for = compile_leaders(self.specs, on_cpu())
        started = self._starting
        deadline = time.monotonic() + timeout_s
        ready: set[int] = set()
        while len(ready) < len(self.specs):
            for i, spec in enumerate(self.specs):
                leader = waits_for[i]
                if i not in started and (leader is None or leader in ready):
                    started[i] = VllmServer(spec, self.spec.log_dir)
            if time.monotonic() > deadline:
                late = [s.port for i, s in enumerate(self.specs) if i not in ready]
                raise EldrError(f"workers on ports {late} not ready after {timeout_s:.0f} s;"
                                f" logs in {self.spec.log_dir}")
            for i, server in list(started.items()):
                if i not in ready and server.poll_ready():
                    ready.add(i)
                    if on_ready is not None:
                        on_ready(server)
            time.sleep(0.5)
        self.servers = [started[i] for i in range(len(self.specs))]

    def restart(self, index: int) -> VllmServer:
        """Replace worker ``index`` (stopped first, whatever its state) by a fresh one on the
        same spec; its log continues the old one's. Returns at once: the proxy's health probes
        see when it is ready."""
        old = self.servers[index]
        # An exited worker's keeper has already ended its tree; one whose engine died gets a
        # moment to shut its API server down before the group is killed.
        old.stop(grace_s=5.0)
        self.servers[index] = VllmServer(old.spec, self.spec.log_dir, append=True)
        return self.servers[index]

    @property
    def prefill_urls(self) -> list[str]:
        return [s.url for s in self.specs if s.role == "prefill"]

    @property
    def decode_urls(self) -> list[str]:
        return [s.url for s in self.specs if s.role == "decode"]

    def compute_groups(self, role: str) -> tuple[int, ...]:
        return compute_groups(self.specs, role)

    def kv_event_endpoints(self, role: str) -> list[str | None]:
        return [s.kv_events for s in self.specs if s.role == role]

    @property
    def expert_event_endpoints(self) -> list[str | None]:
        """Every worker's expert events endpoint, prefill workers first."""
        return [s.expert_events for s in self.specs]

    @property
    def decode_batch_endpoints(self) -> list[str | None]:
        return [s.batch_endpoint for s in self.specs if s.role == "decode"]

    def stop(self) -> None:
        """Signal every worker first, then wait: all shut down in parallel."""
        servers = self.servers or list(self._starting.values())
        for server in servers:
            server.terminate()
        for server in servers:
            server.stop()
        shutil.rmtree(self._kv_dir, ignore_errors=True)  # the workers' sockets, now closed

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
