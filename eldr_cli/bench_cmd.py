"""`eldr bench`: live policy comparison, engine cost measurement, or cluster simulation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from eldr_cli.options import PolicyConfigOption, SeedOption, policy_config
from stages import paths
from stages.errors import EldrError
from stages.routing.policies import POLICIES, needs_centroids
from stages.routing.policy_config import PolicyConfig

if TYPE_CHECKING:
    from stages.bench.simulator import SimConfig
    from stages.fit.artifact import Artifact
    from stages.signature.dataset import SignatureArrays, SignatureDataset

ALL_POLICIES = ",".join(POLICIES)


def _live_rates(text: str) -> list[float]:
    from stages.bench.capacity import parse_rates, resolve_rates

    return resolve_rates(parse_rates(text), None)


def bench(
    url: Annotated[str, typer.Option(help="The eldr proxy.")] = paths.DEFAULT_PROXY_URL,
    policies: Annotated[str, typer.Option(help="Policies to compare, comma separated.")]
    = ALL_POLICIES,
    policy_options: PolicyConfigOption = None,
    prompts: Annotated[Path | None, typer.Option(
        help="JSONL prompts. Default: the bundled evaluation split.", show_default=False)] = None,
    num_prompts: Annotated[int, typer.Option(help="Requests per policy (per rate).", min=1)]
    = 120,
    request_rate: Annotated[str, typer.Option(
        help="Poisson arrival rate(s) in req/s, comma separated; 'inf' sends all at once."
        " --simulate also takes 'N%' of the cluster's capacity (from the cost model, decode"
        " and prefill workers, output length and batch slots) and 'auto' (50%,70%,85%).")]
    = "2",
    max_concurrency: Annotated[int | None, typer.Option(help="Cap on requests in flight.")]
    = None,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request (ignore_eos).")]
    = 64,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds: each runs every policy on a"
                                        " slice of the prompts, in rotating order.", min=1)] = 3,
    result_dir: Annotated[Path | None, typer.Option(
        help="Where JSON results and PNG plots go. Default: $ELDR_HOME/results.",
        show_default=False)] = None,
    seed: SeedOption = 0,
    simulate: Annotated[bool, typer.Option(
        "--simulate", help="Simulate a PD cluster on captured signatures instead.")] = False,
    data: Annotated[Path | None, typer.Option(
        help="--simulate: signature dataset. Default: $ELDR_HOME/signatures.zarr.",
        show_default=False)] = None,
    store: Annotated[Path | None, typer.Option(
        help="--simulate: artifact store (its 'latest' needs at least --decode centroids);"
        " with --replay, default: the store beside each results folder (its ELDR_HOME's)"
        " if it has one.",
        show_default=False)] = None,
    prefill: Annotated[int, typer.Option(help="--simulate: prefill workers.", min=1)] = 8,
    decode: Annotated[int, typer.Option(help="--simulate: decode workers.", min=1)] = 16,
    duration: Annotated[float, typer.Option(help="--simulate: simulated seconds.")] = 120.0,
    output_tokens: Annotated[int | None, typer.Option(
        help="--simulate: fixed output length per request (the paper caps at 512 with"
        " ignore_eos). Default: each captured request's own length.")] = None,
    cost: Annotated[str | None, typer.Option(
        help="--simulate: cost model: 'gpu' (GPU-like preset), 'cpu', or a JSON file from"
        " --engine-cost. Default: gpu; with --replay, each results folder's cost-model.json"
        " (the demo measures it on the live workers).", show_default=False)] = None,
    locality_blend: Annotated[str, typer.Option(
        help="--simulate: locality dial s in [0, 1]: each request's per-step decode expert"
        " probabilities and output length are blended with another request's (seeded) at"
        " weight s; 0 = the data's own, 1 = no locality (prefill predicts nothing). Two or"
        " more values, comma separated, at one request rate: sweep s and plot each policy's"
        " TPOT over the best load balancer against it.")] = "0",
    locality_reference: Annotated[Path | None, typer.Option(
        help="--simulate with a locality sweep: artifact store of an `eldr fit` on your own"
        " data (same --k as the simulation's, so the gains compare); its held-out gain"
        " (prefill-to-decode agreement) is marked on the dial. Default: the simulation's"
        " artifact (--store).", show_default=False)] = None,
    engine_cost: Annotated[bool, typer.Option(
        "--engine-cost", help="Measure decode step time vs distinct experts on the running"
        " decode workers and fit the simulator's cost model.")] = False,
    another_pass: Annotated[bool, typer.Option(
        "--another-pass", help="--engine-cost: measure again, on prompts no earlier pass sent,"
        " and fit over every pass in --result-dir; prints how far the engine drifted since"
        " the first. A pass before a bench and one after it bracket the bench's engine speed."
        )] = False,
    replay: Annotated[list[Path] | None, typer.Option(
        help="--simulate: replay the live run saved in this results folder (repeatable: two"
        " or more runs also give the live run-to-run spread) with its arrivals, prompts"
        " (--data must hold their signatures), output lengths, concurrency cap, workers and"
        " core plan, and print simulated against live per policy.", show_default=False)] = None,
    worker_cores: Annotated[str | None, typer.Option(
        help="--replay: the cores each live worker ran on, '|' separated, prefill workers"
        " first (as `eldr serve --worker-cores`). Default: eldr serve's plan on this"
        " machine's cores.", show_default=False)] = None,
) -> None:
    """Compare routing policies on the live proxy with the same prompts and arrival times
    (policies interleaved through the proxy's admin API), as `vllm bench serve` reports them."""
    result_dir = result_dir or paths.default_result_dir()
    prompts_path = prompts or paths.EVALUATION_PROMPTS
    names = tuple(p.strip() for p in policies.split(",") if p.strip())
    options = policy_config(policy_options)
    if replay and not simulate:
        raise EldrError("--replay simulates a live run: add --simulate")
    if another_pass and not engine_cost:
        raise EldrError("--another-pass adds a pass to an engine-cost measurement: add"
                        " --engine-cost")
    if simulate and replay:
        _replay(replay, data, store, cost, result_dir, seed, prompts,
                tuple(worker_cores.split("|")) if worker_cores else None)
    elif simulate:
        _simulate(data, store, names, request_rate, prefill, decode, duration, cost or "gpu",
                  output_tokens, result_dir, seed, locality_blend, locality_reference, options)
    elif engine_cost:
        _engine_cost(url, prompts_path, result_dir, seed, another_pass)
    else:
        _live(url, names, prompts_path, num_prompts, _live_rates(request_rate), max_concurrency,
              max_tokens, rounds, result_dir, seed, options)


def _num_layers() -> int | None:
    from stages.fit.artifact import ArtifactStore

    store = paths.default_artifact_store()
    if not store.exists():
        return None
    try:
        return ArtifactStore(store).load("latest").identity.num_layers
    except EldrError:
        return None


def _live(url: str, policies: tuple[str, ...], prompts: Path, num_prompts: int,
          rates: list[float], max_concurrency: int | None, max_tokens: int, rounds: int,
          result_dir: Path, seed: int, options: PolicyConfig) -> None:
    from stages.bench.loadgen import BenchConfig, run_rate_sweep
    from stages.bench.plots import write_plots
    from stages.bench.report import format_comparison
    from stages.bench.results import live_shape

    config = BenchConfig(
        url=url.rstrip("/"), policies=policies, prompts_path=prompts, num_prompts=num_prompts,
        request_rate=rates[0], max_concurrency=max_concurrency, seed=seed,
        result_dir=result_dir, max_tokens=max_tokens, rounds=rounds, num_layers=_num_layers(),
        policy_config=options,
    )
    sweep = run_rate_sweep(config, rates)
    for comparison in sweep:
        typer.echo(format_comparison(comparison.metrics(),
                                     f"{url}: {comparison.request_rate:g} req/s,"
                                     f" {num_prompts} requests"
                                     f" per policy, {max_tokens} output tokens"))
    source = " ".join(filter(None, (live_shape(sweep[0].info), "live"))) + f", {url}"
    for path in write_plots(sweep, result_dir, source):
        typer.echo(f"plot: {path}")
    typer.echo(f"results: {result_dir}")


def _engine_cost(url: str, prompts: Path, result_dir: Path, seed: int,
                 another_pass: bool) -> None:
    import asyncio
    from datetime import datetime, timezone

    import httpx

    from stages.bench.admin import ProxyAdmin, decode_worker_urls
    from stages.bench.engine_cost import EngineCostConfig, format_engine_cost, measure_engine_cost
    from stages.bench.engine_cost_passes import (
        PASSES_FILE,
        ProbePass,
        check_same_deployment,
        drift,
        excluded_prompts,
        fit_passes,
        load_passes,
        save_passes,
    )
    from stages.bench.worker_cores import live_core_plan

    async def read_state() -> dict[str, object]:
        async with httpx.AsyncClient() as client:
            return await ProxyAdmin(client, url).state()

    passes_path = result_dir / PASSES_FILE
    # Read before measuring: a missing or foreign file is a user's mistake, said at once.
    earlier = load_passes(passes_path) if another_pass else []
    state = asyncio.run(read_state())
    workers = decode_worker_urls(state)
    layers = _num_layers()
    if layers is None:
        raise EldrError("no artifact to read the model's MoE layer count from; run `eldr fit`")
    if earlier:
        check_same_deployment(earlier[0], workers, layers)
    # Workers of a local `eldr serve` run on its core plan; the measured one shares its core
    # with the others bound there.
    listed = state.get("prefill_workers")
    prefill_urls = tuple(
        str(w["url"]) for w in (listed if isinstance(listed, list) else ())
        if isinstance(w, dict) and w.get("url")
    )
    groups = live_core_plan(len(prefill_urls), len(workers)).decode_groups
    sharing = tuple(groups.count(g) for g in groups)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    # Four batch sizes x (one domain, all domains), every worker at once, after a warm-up
    # batch, bracket the curve and the batches it runs live (~6 a worker in the demo) in ~4
    # minutes on a CPU; prefill is timed on the prefill workers, one prompt at a time (a few
    # seconds). A later pass draws other batches (its own seed) from the prompts not yet sent.
    result = measure_engine_cost(EngineCostConfig(
        worker_urls=workers, prompts_path=prompts, num_layers=layers,
        seed=seed + len(earlier), batch_sizes=(2, 4, 6, 8), domain_mixes=(1, 0), repeats=1,
        max_tokens=32, prefill_probes=8 if prefill_urls else 0, prefill_urls=prefill_urls,
        core_sharing=sharing, exclude_prompts=excluded_prompts(earlier),
    ))
    typer.echo(format_engine_cost(result))
    passes = [*earlier, ProbePass.of(result, started, workers, sharing)]
    if earlier:
        moved = drift(passes[0], passes[-1])
        typer.echo(f"pass {len(passes)} against pass 1 ({passes[0].started}): {moved.describe()}"
                   " of what pass 1's fit predicts at this pass's batches")
        if moved.large:
            typer.echo("warning: the engine's decode steps ran at another speed than in pass"
                       " 1; the fit below averages the passes, and a simulation on it is only"
                       " as close to a live run as the engine's speed during that run", err=True)
        result = fit_passes(passes)
        c = result.model
        counted = c.base_s - result.step_overhead_s
        typer.echo(
            f"fit over {len(passes)} passes ({len(result.measurements)} batches): step ="
            f" {counted * 1e3:.3f} ms + {c.per_token_s * 1e3:.4f} ms x batch + {c.num_layers}"
            f" x {c.per_expert_s * 1e3:.4f} ms x experts/L (R^2 {result.quality['r2']:.3f}),"
            f" plus {result.step_overhead_s * 1e3:.2f} ms a step outside the counted one;"
            f" prefill {c.prefill_base_s * 1e3:.2f} ms + {c.prefill_per_token_s * 1e3:.4f} ms"
            " x tokens")
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / "cost-model.json"
    save_passes(passes_path, passes)
    result.model.save(path)
    typer.echo(f"cost model: {path} (use with `eldr bench --simulate --cost {path}`)")


def _simulate(data: Path | None, store: Path | None, policies: tuple[str, ...],
              request_rate: str, prefill: int, decode: int, duration: float, cost: str,
              output_tokens: int | None, result_dir: Path, seed: int, locality_blend: str,
              locality_reference: Path | None, options: PolicyConfig) -> None:
    from stages.bench.capacity import cluster_capacity, parse_rates, resolve_rates
    from stages.bench.locality_sweep import parse_strengths
    from stages.bench.plots import write_plots
    from stages.bench.report import format_comparison
    from stages.bench.results import ComparisonResult, save_comparison
    from stages.bench.simulator import SimConfig, simulate
    from stages.fit.artifact import load_for_serving
    from stages.routing.cost_model import cost_model_for
    from stages.signature.dataset import SignatureDataset

    specs = parse_rates(request_rate)
    strengths = parse_strengths(locality_blend)
    if len(strengths) > 1 and len(specs) != 1:
        raise EldrError("a locality sweep (several --locality-blend values) runs at one"
                        " --request-rate")
    dataset = SignatureDataset.open(data or paths.default_dataset())
    arrays = dataset.read()
    identity = dataset.identity
    artifact = None
    if any(needs_centroids(name) for name in policies):
        artifact = load_for_serving(store or paths.default_artifact_store(), "latest", identity,
                                    decode)
    model = cost_model_for(cost, identity.num_layers, identity.num_experts)
    base = SimConfig(cost=model, num_prefill=prefill, num_decode=decode, duration_s=duration,
                     policies=policies, output_tokens=output_tokens,
                     max_output_tokens=max(512, output_tokens or 0), seed=seed,
                     locality_blend=strengths[0], policy_config=options)
    capacity = None
    if any(s.of_capacity for s in specs):
        capacity = cluster_capacity(
            model, arrays, identity.top_k, num_prefill=prefill, num_decode=decode,
            max_batch=base.max_batch, output_tokens=output_tokens,
            max_output_tokens=base.max_output_tokens,
            first_token_from_prefill=base.first_token_from_prefill)
    rates = resolve_rates(specs, capacity)
    if capacity is not None:
        chosen = ", ".join(f"{r:g}" + (f" ({s.value:.0%})" if s.of_capacity else "")
                           for s, r in zip(specs, rates, strict=True))
        typer.echo(f"request rates {chosen} req/s: {capacity.describe()}")
    source = f"{prefill}P{decode}D simulated, cost {model.name}, {identity.name}"
    if len(strengths) > 1:
        _locality_sweep(replace(base, request_rate=rates[0]), dataset, arrays, artifact,
                        strengths, identity.top_k, locality_reference, source, result_dir)
        return
    blend = f", locality blend s={strengths[0]:g}" if strengths[0] else ""
    sweep = []
    for rate in rates:
        config = replace(base, request_rate=rate)
        comparison = ComparisonResult(rate, simulate(config, arrays, artifact,
                                                     top_k=identity.top_k))
        sweep.append(comparison)
        save_comparison(comparison, result_dir)
        typer.echo(format_comparison(
            comparison.metrics(), f"simulated {prefill}P{decode}D, {rate:g} req/s,"
            f" {duration:g} s, {model.name} cost, {identity.describe()}{blend}"))
    for path in write_plots(sweep, result_dir, source + blend, prefix="sim-"):
        typer.echo(f"plot: {path}")


def _replay(result_dirs: list[Path], data: Path | None, store: Path | None, cost: str | None,
            result_dir: Path, seed: int, prompts: Path | None,
            worker_cores: tuple[str, ...] | None) -> None:
    import orjson

    from stages.bench.plots import plot_validation
    from stages.bench.replay import results_folder
    from stages.bench.replay_run import replay_run, store_beside
    from stages.bench.validation import format_validation, validate, validation_json
    from stages.routing.cost_model import cost_model_for
    from stages.signature.dataset import SignatureDataset

    dataset = SignatureDataset.open(data or paths.default_dataset())
    arrays = dataset.read()
    identity = dataset.identity
    compared = []
    names = set()
    shapes = []  # what each live run was, for the plot's title
    for folder in result_dirs:
        spec = cost or str(results_folder(folder) / "cost-model.json")
        if cost is None and not Path(spec).is_file():
            raise EldrError(f"{folder} has no cost-model.json (`eldr bench --engine-cost` on the"
                            " live workers writes it); give the cost model with --cost")
        model = cost_model_for(spec, identity.num_layers, identity.num_experts)
        names.add(model.name)
        for replayed in replay_run(folder, arrays, identity, model,
                                   store=store or store_beside(folder), seed=seed,
                                   prompts=prompts, worker_cores=worker_cores):
            for note in replayed.notes:
                typer.echo(f"note: {note}")
            compared.append(replayed.compared)
            run = replayed.run
            shapes.append(f"{replayed.compared.name} {run.shape} live,"
                          f" {run.requests_per_policy} requests per policy")
    checks = validate(compared)
    typer.echo(format_validation(checks))
    result_dir.mkdir(parents=True, exist_ok=True)
    numbers = result_dir / "replay-validation.json"
    numbers.write_bytes(orjson.dumps(validation_json(checks), option=orjson.OPT_INDENT_2))
    plot = plot_validation(checks, result_dir / "replay-validation.png",
                           title=f"simulated against live: replay of {'; '.join(shapes)};"
                           f" cost {', '.join(sorted(names))}")
    typer.echo(f"plot: {plot}")
    typer.echo(f"numbers: {numbers}")


def _locality_sweep(config: SimConfig, dataset: SignatureDataset, arrays: SignatureArrays,
                    artifact: Artifact | None, strengths: list[float], top_k: int,
                    reference_store: Path | None, source: str, result_dir: Path) -> None:
    import orjson

    from stages.bench.locality_sweep import (
        format_dial,
        locality_gauge,
        requests_per_policy,
        run_locality_sweep,
        sweep_json,
    )
    from stages.bench.plots import plot_locality_dial
    from stages.bench.results import rate_label
    from stages.fit.artifact import ArtifactStore

    gauge = None
    if artifact is not None:
        reference = artifact
        name = f"eldr fit {artifact.version} of the simulated data"
        if reference_store is not None:
            reference = ArtifactStore(reference_store).load("latest")
            name = f"eldr fit {reference.version} in {reference_store}"
        gauge = locality_gauge(artifact, dataset.content_hash(), len(arrays), reference, name)
    sweep = run_locality_sweep(config, arrays, artifact, strengths, top_k=top_k, gauge=gauge)
    rate = rate_label(config.request_rate)
    requests = requests_per_policy(sweep.comparisons[0])
    typer.echo(f"locality dial, {source}, {rate} req/s, {config.duration_s:g} s,"
               f" {requests} requests per policy")
    typer.echo(format_dial(sweep))
    result_dir.mkdir(parents=True, exist_ok=True)
    # Not Path.with_suffix: a rate such as 4.12 has a dot of its own.
    numbers = result_dir / f"sim-locality-dial-{rate}qps.json"
    doc = sweep_json(sweep, {"source": source, "duration_s": config.duration_s,
                             "seed": config.seed})
    numbers.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    plot = plot_locality_dial(sweep, result_dir / f"sim-locality-dial-{rate}qps.png",
                              title=f"{source}: locality dial at {rate} req/s,"
                              f" {requests} requests per policy per point")
    typer.echo(f"plot: {plot}")
    typer.echo(f"numbers: {numbers}")
