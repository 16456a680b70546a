"""`eldr bench`: live policy comparison, engine cost measurement, or cluster simulation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from eldr_cli.options import SeedOption
from stages import paths
from stages.errors import EldrError
from stages.routing.policies import needs_centroids

ALL_POLICIES = "eldr,eldr-bl,eldr-union,rr,jsq,random,p2c"


def _rates(text: str) -> list[float]:
    try:
        rates = [math.inf if r.strip() == "inf" else float(r) for r in text.split(",")]
    except ValueError as exc:
        raise EldrError(f"--request-rate takes numbers or 'inf', comma separated: {text}") from exc
    if any(r <= 0 for r in rates):
        raise EldrError("--request-rate must be > 0")
    return rates


def bench(
    url: Annotated[str, typer.Option(help="The eldr proxy.")] = paths.DEFAULT_PROXY_URL,
    policies: Annotated[str, typer.Option(help="Policies to compare, comma separated.")]
    = ALL_POLICIES,
    prompts: Annotated[Path | None, typer.Option(
        help="JSONL prompts. Default: the bundled evaluation split.", show_default=False)] = None,
    num_prompts: Annotated[int, typer.Option(help="Requests per policy (per rate).", min=1)]
    = 120,
    request_rate: Annotated[str, typer.Option(
        help="Poisson arrival rate(s) in req/s, comma separated; 'inf' sends all at once.")]
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
        help="--simulate: artifact store (its 'latest' needs at least --decode centroids).",
        show_default=False)] = None,
    prefill: Annotated[int, typer.Option(help="--simulate: prefill workers.", min=1)] = 8,
    decode: Annotated[int, typer.Option(help="--simulate: decode workers.", min=1)] = 16,
    duration: Annotated[float, typer.Option(help="--simulate: simulated seconds.")] = 120.0,
    output_tokens: Annotated[int | None, typer.Option(
        help="--simulate: fixed output length per request (the paper caps at 512 with"
        " ignore_eos). Default: each captured request's own length.")] = None,
    cost: Annotated[str, typer.Option(
        help="--simulate: cost model: 'gpu' (GPU-like preset), 'cpu', or a JSON file from"
        " --engine-cost.")] = "gpu",
    shuffle_decode: Annotated[bool, typer.Option(
        "--shuffle-decode", help="--simulate: no-locality control: each request decodes as"
        " another (seeded), so prefill signatures predict nothing.")] = False,
    engine_cost: Annotated[bool, typer.Option(
        "--engine-cost", help="Measure decode step time vs distinct experts on the running"
        " decode workers and fit the simulator's cost model.")] = False,
) -> None:
    """Compare routing policies on the live proxy with the same prompts and arrival times
    (policies interleaved through the proxy's admin API), as `vllm bench serve` reports them."""
    result_dir = result_dir or paths.default_result_dir()
    prompts_path = prompts or paths.EVALUATION_PROMPTS
    names = tuple(p.strip() for p in policies.split(",") if p.strip())
    if simulate:
        _simulate(data, store, names, _rates(request_rate), prefill, decode, duration, cost,
                  output_tokens, result_dir, seed, shuffle_decode)
    elif engine_cost:
        _engine_cost(url, prompts_path, result_dir, seed)
    else:
        _live(url, names, prompts_path, num_prompts, _rates(request_rate), max_concurrency,
              max_tokens, rounds, result_dir, seed)


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
          result_dir: Path, seed: int) -> None:
    from stages.bench.loadgen import BenchConfig, run_rate_sweep
    from stages.bench.plots import write_plots
    from stages.bench.report import format_comparison

    config = BenchConfig(
        url=url.rstrip("/"), policies=policies, prompts_path=prompts, num_prompts=num_prompts,
        request_rate=rates[0], max_concurrency=max_concurrency, seed=seed,
        result_dir=result_dir, max_tokens=max_tokens, rounds=rounds, num_layers=_num_layers(),
    )
    sweep = run_rate_sweep(config, rates)
    for comparison in sweep:
        typer.echo(format_comparison(comparison.metrics(),
                                     f"{url}: {comparison.request_rate:g} req/s,"
                                     f" {num_prompts} requests"
                                     f" per policy, {max_tokens} output tokens"))
    workers = sweep[0].info.get("decode_urls") or []
    shape = f"{len(workers)} decode workers behind " if workers else ""
    source = f"live, {shape}{url}, {num_prompts} requests per policy"
    for path in write_plots(sweep, result_dir, source):
        typer.echo(f"plot: {path}")
    typer.echo(f"results: {result_dir}")


def _engine_cost(url: str, prompts: Path, result_dir: Path, seed: int) -> None:
    import asyncio

    import httpx

    from stages.bench.admin import ProxyAdmin, decode_worker_urls
    from stages.bench.engine_cost import EngineCostConfig, format_engine_cost, measure_engine_cost

    async def read_state() -> dict[str, object]:
        async with httpx.AsyncClient() as client:
            return await ProxyAdmin(client, url).state()

    workers = decode_worker_urls(asyncio.run(read_state()))
    layers = _num_layers()
    if layers is None:
        raise EldrError("no artifact to read the model's MoE layer count from; run `eldr fit`")
    # Two batch sizes x (one domain, all domains) bracket the curve in ~3 minutes on a CPU.
    result = measure_engine_cost(EngineCostConfig(
        worker_urls=workers, prompts_path=prompts, num_layers=layers, seed=seed,
        batch_sizes=(2, 8), domain_mixes=(1, 0), repeats=1, max_tokens=32, prefill_probes=0,
    ))
    typer.echo(format_engine_cost(result))
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / "cost-model.json"
    result.model.save(path)
    typer.echo(f"cost model: {path} (use with `eldr bench --simulate --cost {path}`)")


def _simulate(data: Path | None, store: Path | None, policies: tuple[str, ...],
              rates: list[float], prefill: int, decode: int, duration: float, cost: str,
              output_tokens: int | None, result_dir: Path, seed: int,
              shuffle_decode: bool) -> None:
    from stages.bench.plots import write_plots
    from stages.bench.report import format_comparison
    from stages.bench.results import ComparisonResult, save_comparison
    from stages.bench.simulator import SimConfig, simulate
    from stages.fit.artifact import load_for_serving
    from stages.routing.cost_model import cost_model_for
    from stages.signature.dataset import SignatureDataset

    dataset = SignatureDataset.open(data or paths.default_dataset())
    arrays = dataset.read()
    identity = dataset.identity
    artifact = None
    if any(needs_centroids(name) for name in policies):
        artifact = load_for_serving(store or paths.default_artifact_store(), "latest", identity,
                                    decode)
    model = cost_model_for(cost, identity.num_layers, identity.num_experts)
    sweep = []
    for rate in rates:
        config = SimConfig(cost=model, num_prefill=prefill, num_decode=decode,
                           request_rate=rate, duration_s=duration, policies=policies,
                           output_tokens=output_tokens,
                           max_output_tokens=max(512, output_tokens or 0), seed=seed,
                           shuffle_decode=shuffle_decode)
        comparison = ComparisonResult(rate, simulate(config, arrays, artifact,
                                                     top_k=identity.top_k))
        sweep.append(comparison)
        save_comparison(comparison, result_dir)
        control = ", decode profiles shuffled (no locality)" if shuffle_decode else ""
        typer.echo(format_comparison(
            comparison.metrics(), f"simulated {prefill}P{decode}D, {rate:g} req/s,"
            f" {duration:g} s, {model.name} cost, {identity.describe()}{control}"))
    source = f"simulated {prefill}P{decode}D, {model.name} cost, {identity.name}"
    for path in write_plots(sweep, result_dir, source, prefix="sim-"):
        typer.echo(f"plot: {path}")
