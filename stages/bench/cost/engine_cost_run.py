"""`eldr bench --engine-cost`: the engine's cost curve measured on live workers, pass by
pass, fitted into the simulator's cost model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from stages.errors import EldrError


def run_engine_cost(url: str, prompts: Path, result_dir: Path, seed: int, another_pass: bool,
                    num_layers: int | None, echo: Callable[[str], None],
                    warn: Callable[[str], None]) -> None:
    """Measure decode step time against distinct experts on the proxy's decode workers (and
    prefill time on its prefill workers), fit the cost model over this pass and, with
    ``another_pass``, the earlier ones in ``result_dir``, and save both."""
    import asyncio
    from datetime import datetime, timezone

    import httpx

    from stages.bench.cost.engine_cost import (
        EngineCostConfig,
        format_engine_cost,
        measure_engine_cost,
    )
    from stages.bench.cost.engine_cost_passes import (
        PASSES_FILE,
        ProbePass,
        check_same_deployment,
        drift,
        excluded_prompts,
        fit_passes,
        load_passes,
        save_passes,
    )
    from stages.bench.live.admin import ProxyAdmin, decode_worker_urls
    from stages.bench.replay.worker_cores import live_core_plan

    async def read_state() -> dict[str, object]:
        async with httpx.AsyncClient() as client:
            return await ProxyAdmin(client, url).state()

    passes_path = result_dir / PASSES_FILE
    # Read before measuring: a missing or foreign file is a user's mistake, said at once.
    earlier = load_passes(passes_path) if another_pass else []
    state = asyncio.run(read_state())
    workers = decode_worker_urls(state)
    layers = num_layers
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
    echo(format_engine_cost(result))
    passes = [*earlier, ProbePass.of(result, started, workers, sharing)]
    if earlier:
        moved = drift(passes[0], passes[-1])
        echo(f"pass {len(passes)} against pass 1 ({passes[0].started}): {moved.describe()}"
             " of what pass 1's fit predicts at this pass's batches")
        if moved.large:
            warn("warning: the engine's decode steps ran at another speed than in pass"
                 " 1; the fit below averages the passes, and a simulation on it is only"
                 " as close to a live run as the engine's speed during that run")
        result = fit_passes(passes)
        c = result.model
        counted = c.base_s - result.step_overhead_s
        echo(
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
    echo(f"cost model: {path} (use with `eldr bench --simulate --cost {path}`)")
