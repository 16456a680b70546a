"""`eldr bench`: live policy comparison, engine cost measurement, or cluster simulation."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from eldr_cli.options import PolicyConfigOption, SeedOption, policy_config
from stages import paths
from stages.errors import EldrError
from stages.routing.policies import POLICIES

if TYPE_CHECKING:
    from stages.bench.live.conversation_bench import WorkloadChoice
    from stages.bench.workloads.conversations import ConversationSpec
    from stages.routing.policy_config import PolicyConfig

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
    workload_file: Annotated[Path | None, typer.Argument(
        help="--workload sharegpt: the ShareGPT JSON file.", show_default=False)] = None,
    url: Annotated[str, typer.Option(help="The eldr proxy.")] = paths.DEFAULT_PROXY_URL,
    policies: Annotated[str | None, typer.Option(
        help="Policies of the eldr proxy to compare, comma separated. Default: every policy,"
        " or none when --router or --variant is given.", show_default=False)] = None,
    router: Annotated[list[str] | None, typer.Option(
        help="Also bench this OpenAI endpoint as one router, NAME=URL (repeatable; driven as"
        " it is, no admin calls, taking its turn in every round), e.g."
        " vllm-router=http://HOST:PORT.",
        show_default=False)] = None,
    variant: Annotated[list[str] | None, typer.Option(
        help="--workload: also bench a policy of the eldr proxy with its own options, as a row"
        " of its own, LABEL=POLICY:JSON (repeatable), e.g. 'arrival=eldr-kv:{\"decode_choice\":"
        " \"arrival\"}'. The other rows of that policy run with its defaults for the options"
        " a variant sets (under --policy-config's).", show_default=False)] = None,
    workload: Annotated[str | None, typer.Option(
        help="Traffic with history: 'conversations' (the bundled generator: a shared system"
        " prompt + the history with the server's real answers + a new message per turn) or"
        " 'sharegpt FILE'. Every router in every round gets fresh conversations.",
        show_default=False)] = None,
    turns: Annotated[int, typer.Option(help="--workload: turns per conversation.", min=1)] = 3,
    conversations: Annotated[int | None, typer.Option(
        help="--workload: conversations per router per round (default 12); --simulate: in all"
        " (default 600).", min=1, show_default=False)] = None,
    system_prompts: Annotated[int, typer.Option(
        help="--workload conversations: distinct shared system prompts.", min=1)] = 1,
    system_tokens: Annotated[int, typer.Option(
        help="--workload conversations: tokens of each system prompt.", min=0)] = 256,
    message_tokens: Annotated[int, typer.Option(
        help="--workload: each user message cut to this many tokens (a ShareGPT file's too).",
        min=1)]
    = 128,
    think_time: Annotated[float, typer.Option(
        help="--workload: seconds from an answer to the next turn.", min=0.0)] = 1.0,
    tokenizer: Annotated[Path | None, typer.Option(
        help="--workload: the served model's tokenizer folder (histories are capped in its"
        " tokens below its length). Default: the bundled tiny model's.", show_default=False)]
    = None,
    max_model_len: Annotated[int | None, typer.Option(
        help="--workload: the served model's length. Default: the tokenizer's.",
        show_default=False)] = None,
    block_size: Annotated[int | None, typer.Option(
        help="--workload: KV block size for the ideal hit share. Default: a prefill worker's"
        " (vllm:cache_config_info), else 32.", show_default=False)] = None,
    prefill_urls: Annotated[str | None, typer.Option(
        help="--workload: prefill workers whose prefix-cache counters to read, comma"
        " separated. Default: the eldr proxy's (/admin/state) when a policy is benched.",
        show_default=False)] = None,
    decode_urls: Annotated[str | None, typer.Option(
        help="Decode workers whose counters to read (KV pulled, experts), comma separated."
        " Default: the eldr proxy's (/admin/state) when a policy is benched.",
        show_default=False)] = None,
    cache_blocks: Annotated[int, typer.Option(
        help="--simulate --workload: each worker's prefix cache, in KV blocks (an LRU).",
        min=1)] = 8192,
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
    max_concurrency: Annotated[int | None, typer.Option(
        help="Cap on requests in flight; with --workload, conversations in flight (default"
        " 3).", show_default=False)] = None,
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
    options = policy_config(policy_options)
    default_policies = "" if router or variant else ALL_POLICIES
    names = tuple(p.strip() for p in (policies or default_policies).split(",") if p.strip())
    if workload is None and workload_file is not None:
        raise EldrError(f"a workload FILE ({workload_file}) goes with --workload sharegpt")
    if variant and (workload is None or simulate):
        raise EldrError("--variant is a row of the live conversation bench: add --workload"
                        " (not with --simulate)")
    if router and (simulate or engine_cost):
        raise EldrError("--router benches a live endpoint: not with --simulate or --engine-cost")
    if workload is not None:
        from stages.bench.workloads.conversations import ConversationSpec

        spec = ConversationSpec(conversations or (600 if simulate else 12), turns,
                                system_prompts, system_tokens, message_tokens, think_time)
        choice = _workload_choice(workload, workload_file, spec, prompts_path)
        if simulate:
            _conversation_sim(choice, policies, request_rate, prefill, decode, cost, data, store,
                              block_size, cache_blocks, max_model_len, output_tokens, seed,
                              result_dir, options)
            return
        _conversation_bench(choice, url, names, router or [], variant or [], tokenizer,
                            max_model_len, block_size, prefill_urls, decode_urls,
                            max_concurrency, max_tokens, rounds, seed, result_dir, options)
        return
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
        from stages.bench.live.targets import parse_router, parse_urls

        rates = _live_rates(request_rate)
        run_live(BenchConfig(
            url=url.rstrip("/"), policies=names, prompts_path=prompts_path,
            num_prompts=num_prompts, request_rate=rates[0], max_concurrency=max_concurrency,
            seed=seed, result_dir=result_dir, max_tokens=max_tokens, rounds=rounds,
            num_layers=artifact_num_layers() if names else None, policy_config=options,
            routers=tuple(parse_router(r) for r in router or ()),
            decode_urls=parse_urls(decode_urls),
        ), rates, typer.echo)


def _workload_choice(workload: str, file: Path | None, spec: ConversationSpec,
                     prompts_path: Path) -> WorkloadChoice:
    from stages.bench.live.conversation_bench import WorkloadChoice

    if workload not in ("conversations", "sharegpt"):
        raise EldrError(f"unknown --workload {workload!r}; choose conversations or sharegpt")
    if workload == "sharegpt" and file is None:
        raise EldrError("--workload sharegpt needs the file: --workload sharegpt FILE")
    if workload == "conversations" and file is not None:
        raise EldrError(f"--workload conversations takes no file (got {file})")
    return WorkloadChoice(workload, spec, prompts_path, file)


def _conversation_bench(choice: WorkloadChoice, url: str, names: tuple[str, ...],
                        routers: list[str], variants: list[str],
                        tokenizer_dir: Path | None, max_model_len: int | None,
                        block_size: int | None, prefill_urls: str | None,
                        decode_urls: str | None, max_concurrency: int | None, max_tokens: int,
                        rounds: int, seed: int, result_dir: Path, options: PolicyConfig) -> None:
    from stages.bench.live.conversation_bench import conversation_source, run_conversation_bench
    from stages.bench.live.conversation_run import ConversationBenchConfig
    from stages.bench.live.live_run import artifact_num_layers
    from stages.bench.live.targets import bench_targets, parse_urls, parse_variant
    from stages.bench.workloads.chat_tokens import HfChatTokenizer
    from stages.bench.workloads.conversations import check_fits

    targets = bench_targets(url, names, routers, [parse_variant(v) for v in variants], options)
    tok = HfChatTokenizer(tokenizer_dir or paths.BUNDLED_MODELS_DIR / "tiny", max_model_len)
    spec = choice.spec
    if choice.kind == "conversations":
        check_fits(spec, max_tokens, tok.max_model_len)
    config = ConversationBenchConfig(
        targets=targets, source=conversation_source(choice, tok, seed),
        tokenizer=tok, turns=spec.turns, max_concurrency=max_concurrency or 3,
        think_time_s=spec.think_time_s, max_tokens=max_tokens, rounds=rounds, seed=seed,
        num_layers=artifact_num_layers() if names or variants else None,
        policy_config=options,
    )
    describe = (f"{choice.kind}: {spec.conversations} conversations x {spec.turns} turns per"
                f" router per round, {config.max_concurrency} at a time, think"
                f" {spec.think_time_s:g} s, {max_tokens} output tokens")
    run_conversation_bench(config, parse_urls(prefill_urls), parse_urls(decode_urls),
                           block_size, result_dir, describe, typer.echo)


def _conversation_sim(choice: WorkloadChoice, policies: str | None, request_rate: str,
                      prefill: int, decode: int, cost: str | None, data: Path | None,
                      store: Path | None, block_size: int | None, cache_blocks: int,
                      max_model_len: int | None, output_tokens: int | None, seed: int,
                      result_dir: Path, options: PolicyConfig) -> None:
    """The conversation workload simulated: ``--request-rate`` is new conversations a
    second; messages and system prompts are synthetic token ids of the spec's lengths."""
    from stages.bench.sim.conversation_sim_run import (
        CONVERSATION_POLICIES,
        ConversationSimOptions,
        run_conversation_sim,
    )
    from stages.bench.sim.conversation_workload import SimConversationSpec

    if choice.kind != "conversations":
        raise EldrError("--simulate takes --workload conversations (a ShareGPT file's text"
                        " is replayed live only)")
    try:
        rate = float(request_rate)
    except ValueError as exc:
        raise EldrError(f"--simulate --workload: --request-rate is new conversations a second,"
                        f" one number; got {request_rate!r}") from exc
    spec = choice.spec
    names = (tuple(p.strip() for p in policies.split(",") if p.strip()) if policies
             else CONVERSATION_POLICIES)
    workload = SimConversationSpec(
        conversations=spec.conversations, turns=spec.turns, conversation_rate=rate,
        think_time_s=spec.think_time_s, system_prompts=spec.system_prompts,
        system_tokens=spec.system_tokens, message_tokens=spec.message_tokens,
        output_tokens=output_tokens or 256, max_model_len=max_model_len or 32768, seed=seed)
    run_conversation_sim(ConversationSimOptions(
        policies=names, workload=workload, result_dir=result_dir, data=data, store=store,
        prefill=prefill, decode=decode, cost=cost or "gpu", block_size=block_size or 16,
        cache_blocks=cache_blocks, seed=seed, policy_config=options), typer.echo)
