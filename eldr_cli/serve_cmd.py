"""`eldr serve`."""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from eldr_cli.options import (
    EagerOption,
    ModelOption,
    PolicyConfigOption,
    SeedOption,
    policy_config,
)
from stages import paths
from stages.errors import EldrError
from stages.routing.policies import POLICIES, needs_centroids, reads_signatures


def serve(
    model: ModelOption = "tiny",
    prefill_model: Annotated[str | None, typer.Option(
        help="Run prefill workers on this routing-identical variant of --model (same"
        " eldr_routing_id and KV shapes), e.g. tiny for tiny-wide: the KV cache and signatures"
        " are the same, and prefill skips the wide model's zero units. Default: --model.",
        show_default=False)] = None,
    prefill: Annotated[int, typer.Option(help="Prefill workers to start.", min=1)] = 1,
    decode: Annotated[int, typer.Option(help="Decode workers to start.", min=1)] = 2,
    policy: Annotated[str, typer.Option(help=f"Decode routing: {', '.join(POLICIES)} (README:"
                                        " which policy). The admin API switches it later.")]
    = "eldr",
    policy_options: PolicyConfigOption = None,
    artifact: Annotated[str, typer.Option(help="Artifact version from `eldr fit` (or 'latest').")]
    = "latest",
    store: Annotated[Path | None, typer.Option(help="Artifact store. Default: $ELDR_HOME/"
                                               "artifacts.", show_default=False)] = None,
    host: Annotated[str, typer.Option(help="Proxy bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Proxy port.")] = 8000,
    worker_port: Annotated[int, typer.Option(help="First port of the started vLLM workers.")]
    = 8100,
    nixl_port: Annotated[int | None, typer.Option(
        help="First NIXL side-channel port of the started workers (one per worker, in order)."
        " Default: ports the system reports free, so deployments on one host never share one.",
        min=1, max=65535, show_default=False)] = None,
    attach_prefill: Annotated[list[str] | None, typer.Option(
        help="URL of a running prefill worker (repeat); starts no workers.")] = None,
    attach_decode: Annotated[list[str] | None, typer.Option(
        help="URL of a running decode worker (repeat); starts no workers.")] = None,
    online_refit: Annotated[bool, typer.Option(help="Refit centroids on recent signatures"
                                               " every few seconds.")] = False,
    worker_cores: Annotated[str | None, typer.Option(
        help="CPU cores per started worker, '|'-separated, prefill workers first, e.g."
        " '0|0|1' (a light --prefill-model sharing core 0 with a decode worker). Default: prefill"
        " and decode get separate core pools.", show_default=False)] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Per-worker batch limit (vLLM"
                                              " --max-num-seqs).")] = 8,
    max_model_len: Annotated[int, typer.Option(help="vLLM --max-model-len.")] = 1024,
    enforce_eager: EagerOption = False,
    prefill_tp: Annotated[int, typer.Option(
        "--prefill-tp", min=1, help="vLLM --tensor-parallel-size of each started prefill"
        " worker (GPUs each; on CPU, a core per rank).")] = 1,
    decode_tp: Annotated[int, typer.Option(
        "--decode-tp", min=1, help="vLLM --tensor-parallel-size of each started decode"
        " worker.")] = 1,
    served_model_name: Annotated[str | None, typer.Option(
        help="Model name clients use (vLLM --served-model-name). Default: --model as typed.",
        show_default=False)] = None,
    vllm_arg: Annotated[list[str] | None, typer.Option(
        "--vllm-arg", help="Extra vLLM engine argument for every started worker (repeat), e.g."
        " --vllm-arg='--dtype=half' --vllm-arg='--gpu-memory-utilization 0.8'. Flags eldr"
        " sets itself (ports, kv-transfer config, model, batch limits) are refused.",
        show_default=False)] = None,
    api_key: Annotated[str | None, typer.Option(
        envvar=["ELDR_API_KEY", "VLLM_API_KEY"], help="Key clients must send (Authorization:"
        " Bearer) on /v1 and /admin routes, as vLLM's --api-key.", show_default=False)] = None,
    admin_api_key: Annotated[str | None, typer.Option(
        envvar="ELDR_ADMIN_API_KEY", help="A separate key for the /admin routes (policy and"
        " artifact switches). Default: --api-key.", show_default=False)] = None,
    worker_api_key: Annotated[str | None, typer.Option(
        envvar="ELDR_WORKER_API_KEY", help="Key the proxy sends to attached workers started"
        " with vLLM's --api-key.", show_default=False)] = None,
    skip_self_check: Annotated[bool, typer.Option(
        "--skip-self-check", help="Do not check that workers record expert signatures (at"
        " start, and each time one rejoins rotation): for plain vLLM workers behind a load"
        " balancer. Only with a policy that reads none"
        f" ({', '.join(n for n in POLICIES if not reads_signatures(n))}); the admin API then"
        " refuses the others.")] = False,
    log_level: Annotated[str, typer.Option(
        help="Proxy log level: debug, info, warning, error (worker logs go to their files).",
        case_sensitive=False)] = "warning",
    seed: SeedOption = 0,
) -> None:
    """Start vLLM prefill and decode workers (real OpenAI servers with eldr's connector) and
    the routing proxy in front of them. A started worker whose process ends is restarted.
    Ctrl-C or SIGTERM stops everything started, and so does this process's death."""
    from stages.engine import on_cpu
    from stages.fit.artifact import load_for_serving
    from stages.models import check_handoff_compatible, resolve_model
    from stages.serve.auth import warn_if_exposed
    from stages.serve.config import ProxyConfig, check_key, check_unchecked_policy
    from stages.serve.engine_args import check_recordable, engine_args
    from stages.serve.launcher import Cluster, ClusterSpec
    from stages.serve.metrics import no_restarts
    from stages.serve.ports import check_free
    from stages.serve.proxy import run_proxy
    from stages.serve.self_check import check_records_signatures
    from stages.serve.supervisor import Supervisor
    from stages.vllm_compat import check_vllm

    if log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
        raise EldrError(f"--log-level {log_level!r}: use debug, info, warning or error")
    options = policy_config(policy_options)
    if skip_self_check:
        check_unchecked_policy(policy)
    extra_args = engine_args(vllm_arg or ())
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        check_recordable(extra_args, tp, on_cpu(), role)
    if not (attach_prefill or attach_decode):
        check_vllm()  # attached workers run their own vLLM: the self-check covers them
    served_as = served_model_name or model
    attach = bool(attach_prefill or attach_decode)
    for name, key in (("--api-key", api_key), ("--admin-api-key", admin_api_key),
                      ("--worker-api-key", worker_api_key)):
        check_key(name, key)  # before anything starts
    exposed = warn_if_exposed(host, api_key)
    if exposed is not None:
        typer.secho(f"eldr: warning: {exposed}", fg=typer.colors.YELLOW, err=True)
    if attach and extra_args:
        raise EldrError("--vllm-arg configures workers eldr starts; it cannot be used with"
                        " --attach-*")
    if attach and nixl_port is not None:
        raise EldrError("--nixl-port configures workers eldr starts; it cannot be used with"
                        " --attach-*")
    if attach and not (attach_prefill and attach_decode):
        raise EldrError("--attach-prefill and --attach-decode must be given together")
    store_path = store or paths.default_artifact_store()
    resolved = resolve_model(model)
    prefill_resolved = None
    if prefill_model is not None:
        if attach_prefill or attach_decode:
            raise EldrError("--prefill-model starts workers; it cannot be used with --attach-*")
        prefill_resolved = resolve_model(prefill_model)
        check_handoff_compatible(prefill_resolved, resolved)
    num_decode = len(attach_decode) if attach_decode else decode
    if needs_centroids(policy):
        load_for_serving(store_path, artifact, resolved.identity, num_decode)

    def stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # Everything is checked before the first worker starts: the cluster's specs (cores, free
    # worker and NIXL ports) and the proxy's whole config, built on the URLs workers will have.
    cluster = None
    if attach:
        prefill_urls, decode_urls = list(attach_prefill or []), list(attach_decode or [])
    else:
        cluster = Cluster(ClusterSpec(
            model=resolved.source, served_name=served_as, prefill=prefill, decode=decode,
            prefill_model=prefill_resolved.source if prefill_resolved else None,
            base_port=worker_port, nixl_base_port=nixl_port, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, log_dir=paths.eldr_home() / "logs",
            worker_cores=tuple(worker_cores.split("|")) if worker_cores else None,
            enforce_eager=enforce_eager,
            extra_args=extra_args, prefill_tp=prefill_tp, decode_tp=decode_tp,
        ))
        prefill_urls, decode_urls = cluster.prefill_urls, cluster.decode_urls
        taken = {s.port for s in cluster.specs} | {s.nixl_side_channel_port for s in cluster.specs}
        if port in taken:
            raise EldrError(f"--port {port} is also a port of a started worker (--worker-port"
                            f" {worker_port}, {prefill + decode} workers, or --nixl-port)")
    use_store = needs_centroids(policy) or store_path.exists()
    config = ProxyConfig(
        prefill_urls=tuple(prefill_urls), decode_urls=tuple(decode_urls), policy=policy,
        policy_config=options, artifact_store=store_path if use_store else None,
        artifact_version=artifact, model=served_as, online_refit=online_refit, seed=seed,
        decode_slots=None if attach else max_num_seqs, model_top_k=resolved.identity.top_k,
        api_key=api_key, admin_api_key=admin_api_key, worker_api_key=worker_api_key,
        # Checked below before the proxy opens; the proxy checks each worker that rejoins.
        self_check=None if skip_self_check else resolved.identity,
        checked_at_start=not skip_self_check, skip_self_check=skip_self_check,
    )
    check_free("--port", [port], host)
    supervisor = None
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        if cluster is not None:
            on = resolved.source
            if prefill_resolved is not None:
                on = f"{prefill_resolved.source} (prefill) and {resolved.source} (decode)"
            typer.echo(f"starting {prefill} prefill + {decode} decode vLLM workers on {on}"
                       f" (logs in {cluster.spec.log_dir})")
            from tqdm import tqdm

            with tqdm(total=prefill + decode, desc="workers ready", unit="worker") as bar:
                cluster.start(on_ready=lambda server: bar.update(1))
        if not skip_self_check:  # every worker, started or attached, whatever the policy
            for url in (*prefill_urls, *decode_urls):
                check_records_signatures(url, resolved.identity, served_as, worker_api_key)
        if cluster is not None:
            supervisor = Supervisor(cluster)
            supervisor.start()
        typer.echo(f"proxy on http://{host}:{port} (policy {policy}); Ctrl-C stops everything")
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal; our
        # handler turns that into KeyboardInterrupt so the workers below are still stopped.
        run_proxy(config, host=host, port=port, log_level=log_level.lower(),
                  restarts=supervisor.restarts if supervisor is not None else no_restarts)
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
