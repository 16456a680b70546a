"""`eldr serve` as functions: the options as one value, every rule checked before anything
starts (``plan``), then the workers, their self-check, the supervisor and the proxy (``run``).

The CLI only parses flags into ``ServeOptions``; tests build one directly.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType

from stages import paths
from stages.errors import EldrError
from stages.models import ResolvedModel
from stages.routing.policies import needs_centroids
from stages.routing.policy_config import PolicyConfig
from stages.serve.cluster import launcher
from stages.serve.proxy.config import KVConfig, ProxyConfig
from stages.serve.proxy.recording.recorder import RecordConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class ServeOptions:
    """What `eldr serve` was asked for (flag names in the comments where they differ)."""

    model: str = "tiny"
    prefill_model: str | None = None
    prefill: int = 1
    decode: int = 2
    policy: str = "eldr-kv"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    artifact: str = "latest"
    store: Path | None = None  # default: $ELDR_HOME/artifacts
    host: str = "127.0.0.1"
    port: int = 8000
    worker_port: int = 8100
    nixl_port: int | None = None
    attach_prefill: tuple[str, ...] = ()
    attach_decode: tuple[str, ...] = ()
    attach_batch: tuple[str, ...] = ()  # each attached decode worker's batch endpoint
    # each attached worker's KV event endpoint, prefill workers first
    attach_kv_events: tuple[str, ...] = ()
    proxy_workers: int = 1  # proxy processes on --port
    peers: tuple[str, ...] = ()  # --peer: other proxies in front of the same workers
    online_refit: bool = False
    worker_cores: str | None = None  # '|'-separated, prefill workers first
    max_num_seqs: int = 8
    max_model_len: int = 1024
    max_queued: int | None = 256  # requests in flight beyond the decode slots; None: no bound
    enforce_eager: bool = False
    prefill_tp: int = 1
    decode_tp: int = 1
    served_model_name: str | None = None
    vllm_args: tuple[str, ...] = ()  # --vllm-arg, as typed
    api_key: str | None = None
    insecure: bool = False  # serve /v1 beyond loopback without an API key
    admin_api_key: str | None = None
    worker_api_key: str | None = None
    skip_self_check: bool = False
    log_level: str = "warning"
    seed: int = 0
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    record: RecordConfig | None = None  # --record: append routed requests to a dataset

    @property
    def attach(self) -> bool:
        return bool(self.attach_prefill or self.attach_decode)

    @property
    def served_as(self) -> str:
        """The model name clients use: --served-model-name, or --model as typed."""
        return self.served_model_name or self.model

    def check(self) -> None:
        """The rules between flags, each a user error naming the flags."""
        from stages.serve.proxy.config import check_key, check_unchecked_policy

        if self.log_level.lower() not in LOG_LEVELS:
            raise EldrError(f"--log-level {self.log_level!r}: use debug, info, warning or error")
        if self.skip_self_check:
            check_unchecked_policy(self.policy)
        if self.proxy_workers < 1:
            raise EldrError(f"--proxy-workers must be >= 1, got {self.proxy_workers}")
        bad_peers = [u for u in self.peers if not u.startswith(("http://", "https://"))]
        if bad_peers:
            raise EldrError(f"--peer {bad_peers[0]!r}: the http:// address of another proxy,"
                            " e.g. http://10.0.0.2:8000")
        if self.online_refit and (self.proxy_workers > 1 or self.peers):
            raise EldrError("--online-refit runs in one proxy: each of several would refit its"
                            " own centroids on its share of the traffic; drop --proxy-workers"
                            " and --peer, or --online-refit")
        for name, key in (("--api-key", self.api_key), ("--admin-api-key", self.admin_api_key),
                          ("--worker-api-key", self.worker_api_key)):
            check_key(name, key)
        if self.attach_batch and len(self.attach_batch) != len(self.attach_decode):
            raise EldrError(f"--attach-batch names {len(self.attach_batch)} endpoints for"
                            f" {len(self.attach_decode)} --attach-decode workers: one each, in"
                            " the same order")
        bad = [e for e in self.attach_batch if not e.startswith("tcp://")]
        if bad:
            raise EldrError(f"--attach-batch {bad[0]!r}: a tcp:// endpoint, e.g."
                            " tcp://d0:5600")
        if self.record is not None and self.proxy_workers > 1:
            raise EldrError("--record writes one dataset from one process: drop --proxy-workers,"
                            " or record with one proxy beside the others (--attach-*)")
        if self.attach_kv_events:
            from stages.routing.kv.endpoints import replay_endpoint

            workers = len(self.attach_prefill) + len(self.attach_decode)
            if len(self.attach_kv_events) != workers:
                raise EldrError(f"--attach-kv-events names {len(self.attach_kv_events)}"
                                f" endpoints for {workers} attached workers: one each, prefill"
                                " workers first, in --attach-* order")
            for endpoint in self.attach_kv_events:
                replay_endpoint(endpoint)  # a user error if it is not one
        if not self.attach:
            return
        if self.record is not None and not self.attach_batch:
            raise EldrError("--record needs each decode worker's measured decode: give"
                            " --attach-batch for every --attach-decode (workers started with"
                            " `eldr worker-args decode --publish-batch`)")
        for flag, given in (("--vllm-arg", bool(self.vllm_args)),
                            ("--nixl-port", self.nixl_port is not None)):
            if given:
                raise EldrError(f"{flag} configures workers eldr starts; it cannot be used with"
                                " --attach-*")
        if not (self.attach_prefill and self.attach_decode):
            raise EldrError("--attach-prefill and --attach-decode must be given together")
        if self.prefill_model is not None:
            raise EldrError("--prefill-model starts workers; it cannot be used with --attach-*")


@dataclass(frozen=True)
class ServePlan:
    """A deployment checked in full: nothing has started yet."""

    options: ServeOptions
    model: ResolvedModel
    prefill_model: ResolvedModel | None
    cluster: launcher.Cluster | None  # None: attached workers only
    proxy: ProxyConfig
    warning: str | None  # for the user, before anything starts



def _platform_defaults(config: PolicyConfig, attached: bool, cpu: bool) -> PolicyConfig:
    """The policies' own cost default is the GPU-like preset; workers eldr starts on CPUs are
    priced with the CPU one (measured on vLLM's CPU MoE kernel), so a KV pull, a queued prefill
    token and an expert weigh what they cost there. Attached workers' platform is not known
    here: ``--policy-config`` says it for them."""
    return config.with_default("cost", "cpu") if cpu and not attached else config


def plan(options: ServeOptions) -> ServePlan:
    """Check every option, the artifact, the models, cores and ports; start nothing."""
    from stages.engine import on_cpu
    from stages.fit.artifact import load_for_serving
    from stages.models import check_handoff_compatible, resolve_model
    from stages.procs.platform_check import require_process_ownership
    from stages.serve.cluster.engine_args import check_recordable, engine_args
    from stages.serve.cluster.ports import check_free
    from stages.serve.proxy.front.auth import check_exposure
    from stages.vllm_compat import gate

    o = options
    o.check()
    warning = check_exposure(o.host, o.api_key, o.insecure)
    extra_args = engine_args(o.vllm_args)
    for role, tp in (("prefill", o.prefill_tp), ("decode", o.decode_tp)):
        check_recordable(extra_args, tp, on_cpu(), role)
    if not o.attach:
        require_process_ownership()
        # Attached workers run their own vLLM: the self-check covers them. A release eldr's
        # real tests did not run on serves with a warning; one missing a touchpoint is refused.
        vllm_warning = gate().warning
        warning = "; ".join(w for w in (warning, vllm_warning) if w) or None
    store = o.store or paths.default_artifact_store()
    model = resolve_model(o.model)
    prefill_model = None
    if o.prefill_model is not None:
        prefill_model = resolve_model(o.prefill_model)
        check_handoff_compatible(prefill_model, model)
    num_decode = len(o.attach_decode) if o.attach else o.decode
    if needs_centroids(o.policy):
        load_for_serving(store, o.artifact, model.identity, num_decode)
    # The cluster's specs (cores, free worker and NIXL ports) are checked as it is built, and
    # the proxy's config on the URLs the workers will have.
    cluster = None
    batch_endpoints: tuple[str | None, ...] = ()
    if o.attach:
        prefill_urls, decode_urls = o.attach_prefill, o.attach_decode
        batch_endpoints = o.attach_batch
    else:
        cluster = _cluster(o, model, prefill_model, extra_args)
        prefill_urls, decode_urls = tuple(cluster.prefill_urls), tuple(cluster.decode_urls)
        batch_endpoints = tuple(cluster.decode_batch_endpoints)
    use_store = needs_centroids(o.policy) or store.exists()
    config = ProxyConfig(
        prefill_urls=prefill_urls, decode_urls=decode_urls, policy=o.policy,
        policy_config=_platform_defaults(o.policy_config, attached=o.attach, cpu=on_cpu()),
        artifact_store=store if use_store else None,
        artifact_version=o.artifact, model=o.served_as,
        online_refit=o.online_refit, seed=o.seed,
        decode_slots=None if o.attach else o.max_num_seqs, max_queued=o.max_queued,
        model_top_k=model.identity.top_k,
        api_key=o.api_key, admin_api_key=o.admin_api_key, worker_api_key=o.worker_api_key,
        # Checked in ``run`` before the proxy opens; the proxy checks each worker that rejoins.
        self_check=None if o.skip_self_check else model.identity,
        checked_at_start=not o.skip_self_check, skip_self_check=o.skip_self_check,
        host=o.host, peers=o.peers, decode_batch_endpoints=batch_endpoints,
        record=o.record, kv=_kv_config(o, model, cluster),
    )
    check_free("--port", [o.port], o.host)
    return ServePlan(o, model, prefill_model, cluster, config, warning)


def _kv_config(o: ServeOptions, model: ResolvedModel,
               cluster: launcher.Cluster | None) -> KVConfig | None:
    """KV-aware routing's settings: the workers' KV event endpoints (the started workers'
    own, or --attach-kv-events), and their model's tokenizer."""
    if cluster is not None:
        prefill, decode = cluster.kv_event_endpoints("prefill"), cluster.kv_event_endpoints(
            "decode")
    elif o.attach_kv_events:
        split = len(o.attach_prefill)
        prefill, decode = list(o.attach_kv_events[:split]), list(o.attach_kv_events[split:])
    else:
        return None
    experts = cluster.expert_event_endpoints if cluster is not None else []
    return KVConfig(tokenizer=model.source, prefill_events=tuple(prefill),
                    decode_events=tuple(decode),
                    expert_events=tuple(experts) if any(experts) else (),
                    prefill_compute=cluster.compute_groups("prefill") if cluster else ())


def _cluster(o: ServeOptions, model: ResolvedModel, prefill_model: ResolvedModel | None,
             extra_args: tuple[str, ...]) -> launcher.Cluster:
    cluster = launcher.Cluster(launcher.ClusterSpec(
        model=model.source, served_name=o.served_as, prefill=o.prefill,
        decode=o.decode, prefill_model=prefill_model.source if prefill_model else None,
        base_port=o.worker_port, nixl_base_port=o.nixl_port, max_model_len=o.max_model_len,
        max_num_seqs=o.max_num_seqs, log_dir=paths.eldr_home() / "logs",
        worker_cores=tuple(o.worker_cores.split("|")) if o.worker_cores else None,
        enforce_eager=o.enforce_eager, extra_args=extra_args, prefill_tp=o.prefill_tp,
        decode_tp=o.decode_tp, expert_events=o.policy == "eldr-kv",
    ))
    taken = {p for s in cluster.specs
             for p in (s.port, s.nixl_side_channel_port, s.batch_port) if p is not None}
    if o.port in taken:
        raise EldrError(f"--port {o.port} is also a port of a started worker (--worker-port"
                        f" {o.worker_port}, {o.prefill + o.decode} workers, --nixl-port, or a"
                        " decode worker's batch publisher)")
    return cluster


def run(deployment: ServePlan, echo: Callable[[str], None]) -> None:
    """Start the workers, check each records signatures, supervise them and serve the proxy
    until SIGINT or SIGTERM; then stop everything started, whatever happened."""
    from stages.serve.cluster.supervisor import Supervisor
    from stages.serve.proxy.group import serve_group
    from stages.serve.proxy.ops.rejoin import no_restarts
    from stages.serve.proxy.ops.self_check import (
        agreed_served_name,
        check_records_signatures,
        read_served_name,
    )

    o, cluster, config = deployment.options, deployment.cluster, deployment.proxy

    def stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    supervisor = None
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        if cluster is not None:
            _start(deployment, cluster, echo)
        if not o.skip_self_check:  # every worker, started or attached, whatever the policy
            if o.attach:  # the name they serve under is theirs, vLLM's default their path
                config = replace(config, model=agreed_served_name(
                    {url: read_served_name(url, o.worker_api_key)
                     for url in (*config.prefill_urls, *config.decode_urls)},
                    o.served_model_name))
            for url in (*config.prefill_urls, *config.decode_urls):
                check_records_signatures(url, deployment.model.identity, config.model,
                                         o.worker_api_key)
        if cluster is not None:
            supervisor = Supervisor(cluster)
            supervisor.start()
        processes = f", {o.proxy_workers} processes" if o.proxy_workers > 1 else ""
        echo(f"proxy on http://{o.host}:{o.port} (policy {o.policy}{processes}); Ctrl-C stops"
             " everything")
        # The proxies drain on SIGINT/SIGTERM (503 to new requests while those in flight
        # finish), then re-raise the signal; our handler turns that into KeyboardInterrupt so
        # the workers below are stopped only after the drain.
        serve_group(config, o.host, o.port, o.proxy_workers, log_level=o.log_level.lower(),
                    restarts=supervisor.restarts if supervisor is not None else no_restarts,
                    drain_timeout_s=o.drain_timeout,
                    on_ready=lambda: echo(f"ready on http://{o.host}:{o.port}: every proxy"
                                          " heard its workers (/health ok)"))
    finally:
        # A second Ctrl-C or SIGTERM must not cut the clean-up short and orphan workers.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if supervisor is not None:
            supervisor.stop()  # no restart may race the stop below
        if cluster is not None:
            cluster.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _start(deployment: ServePlan, cluster: launcher.Cluster, echo: Callable[[str], None]) -> None:
    from tqdm import tqdm

    o = deployment.options
    on = deployment.model.source
    if deployment.prefill_model is not None:
        on = f"{deployment.prefill_model.source} (prefill) and {on} (decode)"
    echo(f"starting {o.prefill} prefill + {o.decode} decode vLLM workers on {on}"
         f" (logs in {cluster.spec.log_dir})")
    with tqdm(total=o.prefill + o.decode, desc="workers ready", unit="worker") as bar:
        cluster.start(on_ready=lambda server: bar.update(1))
