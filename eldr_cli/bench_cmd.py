"""`eldr bench`: live policy comparison, engine cost measurement, or cluster simulation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eldr_cli.options import PolicyConfigOption, SeedOption, policy_config
from stages import paths
from stages.errors import EldrError
from stages.routing.policies import POLICIES

ALL_POLICIES = ",".join(POLICIES)


def _check_modes(simulate: bool, replay: bool, engine_cost: bool, another_pass: bool,
                 proxies_set: bool) -> None:
    if replay and not simulate:
        raise EldrError("--replay simulates a live run: add --simulate")
    if replay and proxies_set:
        # A replay reproduces the live run's one proxy; its live figures would not compare.
        raise EldrError("--proxies and --publish-delay-ms model a --simulate cluster, not a"
                        " --replay of a live run")
    if another_pass and not engine_cost:
        raise EldrError("--another-pass adds a pass to an engine-cost measurement: add"
                        " --engine-cost")


def _live_rates(text: str) -> list[float]:
    from stages.bench.sim.capacity import parse_rates, resolve_rates

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
    proxies: Annotated[int, typer.Option(
        help="--simulate: routing proxies in front of the decode workers (N proxy processes"
        " sharing one port, requests dealt to them in turn), each with its own policy and"
        " in-flight counts: its own assignments at once, the others' only once the decode"
        " workers publish them (--publish-delay-ms).", min=1)] = 1,
    publish_delay_ms: Annotated[float, typer.Option(
        help="--simulate with --proxies > 1: how stale a proxy's view of the other proxies'"
        " assignments and completions is, in ms (the decode workers' publishing interval plus"
        " transport); 0: every proxy sees exact loads.", min=0.0)] = 0.0,
    include_fit_rows: Annotated[bool, typer.Option(
        "--include-fit-rows", help="--simulate: also draw the requests the artifact's centroids"
        " were fit on (by default only those its fit held out, when it was fit on --data).")]
    = False,
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
    _check_modes(simulate, bool(replay), engine_cost, another_pass,
                 proxies != 1 or publish_delay_ms != 0)
    if simulate and replay:
        from stages.bench.replay.replay_check import replay_and_validate

        replay_and_validate(replay, data, store, cost, result_dir, seed, prompts,
                            tuple(worker_cores.split("|")) if worker_cores else None, typer.echo)
    elif simulate:
        from stages.bench.sim.simulate_run import SimulateOptions, run_simulate

        run_simulate(SimulateOptions(
            policies=names, result_dir=result_dir, data=data, store=store,
            request_rate=request_rate, prefill=prefill, decode=decode, duration=duration,
            cost=cost or "gpu", output_tokens=output_tokens, seed=seed,
            locality_blend=locality_blend, locality_reference=locality_reference,
            policy_config=options, include_fit_rows=include_fit_rows, proxies=proxies,
            publish_delay_ms=publish_delay_ms,
        ), typer.echo)
    elif engine_cost:
        from stages.bench.cost.engine_cost_run import run_engine_cost
        from stages.bench.live.live_run import artifact_num_layers

        run_engine_cost(url, prompts_path, result_dir, seed, another_pass, artifact_num_layers(),
                        echo=typer.echo, warn=lambda line: typer.echo(line, err=True))
    else:
        from stages.bench.live.live_run import BenchConfig, artifact_num_layers, run_live

        rates = _live_rates(request_rate)
        run_live(BenchConfig(
            url=url.rstrip("/"), policies=names, prompts_path=prompts_path,
            num_prompts=num_prompts, request_rate=rates[0], max_concurrency=max_concurrency,
            seed=seed, result_dir=result_dir, max_tokens=max_tokens, rounds=rounds,
            num_layers=artifact_num_layers(), policy_config=options,
        ), rates, typer.echo)
