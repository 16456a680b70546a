"""`eldr serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eldr_cli.options import (
    EagerOption,
    ModelOption,
    PolicyConfigOption,
    SeedOption,
    policy_config,
)
from stages.errors import EldrError
from stages.routing.policies import POLICIES, reads_signatures


def serve(
    model: ModelOption = "tiny",
    prefill_model: Annotated[str | None, typer.Option(
        help="Run prefill workers on this routing-identical variant of --model (same"
        " eldr_routing_id and KV shapes), e.g. tiny for tiny-wide: the KV cache and signatures"
        " are the same, and prefill skips the wide model's zero units. Default: --model.",
        show_default=False)] = None,
    prefill: Annotated[int, typer.Option(help="Prefill workers to start.", min=1)] = 1,
    decode: Annotated[int, typer.Option(help="Decode workers to start.", min=1)] = 2,
    policy: Annotated[str, typer.Option(help=f"Routing: {', '.join(POLICIES)} (README:"
                                        " which policy). eldr-kv routes both legs by the KV"
                                        " each worker holds and decode by experts too; the"
                                        " others route prefill by a prefix hash. The admin API"
                                        " switches it later.")]
    = "eldr-kv",
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
    attach_batch: Annotated[list[str] | None, typer.Option(
        help="With --attach-decode: where each decode worker publishes its running batch (repeat,"
        " in --attach-decode order; `eldr worker-args decode --publish-batch`), so several"
        " proxies each route on every proxy's requests.", show_default=False)] = None,
    attach_kv_events: Annotated[list[str] | None, typer.Option(
        help="With --attach-*: where each worker publishes vLLM's KV events (repeat, prefill"
        " workers first, in --attach-* order; `eldr worker-args ROLE --kv-events`), for KV-aware"
        " routing (--policy eldr-kv). A tcp://HOST:PORT endpoint replays on PORT+1.",
        show_default=False)] = None,
    proxy_workers: Annotated[int, typer.Option(
        help="Proxy processes on --port (the kernel spreads connections over them): one relays"
        " about one core's worth of requests and tokens. Admin changes reach all of them and"
        " /metrics shows all of them (label proxy).", min=1)] = 1,
    peer: Annotated[list[str] | None, typer.Option(
        help="Another proxy in front of the same workers (repeat; a URL that reaches that one"
        " process): admin changes made here reach it, and /metrics here includes it.",
        show_default=False)] = None,
    online_refit: Annotated[bool, typer.Option(help="Refit centroids on recent signatures"
                                               " every few seconds (one proxy only).")] = False,
    worker_cores: Annotated[str | None, typer.Option(
        help="CPU cores per started worker, '|'-separated, prefill workers first, e.g."
        " '0|0|1' (a light --prefill-model sharing core 0 with a decode worker). Default: prefill"
        " and decode get separate core pools.", show_default=False)] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Per-worker batch limit (vLLM"
                                              " --max-num-seqs).")] = 8,
    max_model_len: Annotated[int, typer.Option(help="vLLM --max-model-len.")] = 1024,
    max_queued: Annotated[int, typer.Option(
        help="Load shedding: requests in flight beyond the decode workers' batch slots"
        " (--max-num-seqs x decode workers) past which a new one gets 503 with Retry-After."
        " With --attach-* the slots are unknown and it bounds every request in flight: size it"
        " to your cluster.", min=0)] = 256,
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
        " Bearer) on /v1 routes, as vLLM's --api-key; it does not open /admin.",
        show_default=False)] = None,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="Serve /v1 with no API key on an address other machines reach"
        " (refused otherwise); /admin stays locked without --admin-api-key.")] = False,
    admin_api_key: Annotated[str | None, typer.Option(
        envvar="ELDR_ADMIN_API_KEY", help="The key for the /admin routes (policy and"
        " artifact switches). Without it /admin answers 403 once --api-key is set.",
        show_default=False)] = None,
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
    record: Annotated[bool, typer.Option(
        "--record", help="Append the requests routed to a signature dataset `eldr fit` reads:"
        " each one's prefill signature, its decode counts as the decode worker measured them,"
        " lengths and timings (prompts only as a sha256 unless --record-prompts). Start with"
        " --policy eldr-union (no artifact), record, then `eldr fit --data` on it.")] = False,
    record_to: Annotated[Path | None, typer.Option(
        help="With --record: the dataset to append to (created if absent). Default:"
        " $ELDR_HOME/traffic.zarr.", show_default=False)] = None,
    record_rate: Annotated[float, typer.Option(
        help="With --record: the fraction of requests recorded, chosen at random.")] = 1.0,
    record_prompts: Annotated[bool, typer.Option(
        help="With --record: keep each prompt's text, not only its sha256.")] = False,
    drain_timeout: Annotated[float, typer.Option(
        help="On Ctrl-C or SIGTERM: seconds the requests in flight get to finish while new ones"
        " (and /health) get 503; a second signal stops at once. 0 stops at once.", min=0)]
    = 30.0,
) -> None:
    """Start vLLM prefill and decode workers (real OpenAI servers with eldr's connector) and
    the routing proxy in front of them. A started worker whose process ends is restarted.
    Ctrl-C or SIGTERM stops everything started, and so does this process's death."""
    from stages import paths
    from stages.serve import deploy
    from stages.serve.proxy.recording.recorder import RecordConfig

    if not record and (record_to is not None or record_rate != 1.0 or record_prompts):
        raise EldrError("--record-to, --record-rate and --record-prompts go with --record")
    recording = RecordConfig(record_to or paths.default_traffic_dataset(), record_rate,
                             record_prompts) if record else None
    options = deploy.ServeOptions(
        model=model, prefill_model=prefill_model, prefill=prefill, decode=decode, policy=policy,
        policy_config=policy_config(policy_options), artifact=artifact, store=store, host=host,
        port=port, worker_port=worker_port, nixl_port=nixl_port,
        attach_prefill=tuple(attach_prefill or ()), attach_decode=tuple(attach_decode or ()),
        attach_batch=tuple(attach_batch or ()), attach_kv_events=tuple(attach_kv_events or ()),
        proxy_workers=proxy_workers, peers=tuple(peer or ()),
        online_refit=online_refit, worker_cores=worker_cores, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, max_queued=max_queued, enforce_eager=enforce_eager,
        prefill_tp=prefill_tp, decode_tp=decode_tp, served_model_name=served_model_name,
        vllm_args=tuple(vllm_arg or ()), api_key=api_key, insecure=insecure,
        admin_api_key=admin_api_key,
        worker_api_key=worker_api_key, skip_self_check=skip_self_check, log_level=log_level,
        seed=seed, drain_timeout=drain_timeout, record=recording,
    )
    plan = deploy.plan(options)
    if plan.warning is not None:
        typer.secho(f"eldr: warning: {plan.warning}", fg=typer.colors.YELLOW, err=True)
    deploy.run(plan, typer.echo)
