"""`eldr bench` on a live proxy: every policy on the same prompts and arrivals, then the
comparison table and the plots."""

from __future__ import annotations

from collections.abc import Callable

from stages import paths
from stages.bench.live.loadgen import BenchConfig
from stages.errors import EldrError

__all__ = ["BenchConfig", "artifact_num_layers", "run_live"]


def artifact_num_layers() -> int | None:
    """The MoE layer count of the latest artifact in the default store, if there is one."""
    from stages.fit.artifact import ArtifactStore

    store = paths.default_artifact_store()
    if not store.exists():
        return None
    try:
        return ArtifactStore(store).load("latest").identity.num_layers
    except EldrError:
        return None


def run_live(config: BenchConfig, rates: list[float], echo: Callable[[str], None]) -> None:
    """Bench ``config``'s policies at each rate (``config.request_rate`` is replaced)."""
    from stages.bench.live.loadgen import run_rate_sweep
    from stages.bench.plots import write_plots
    from stages.bench.report import format_comparison
    from stages.bench.results import live_shape

    sweep = run_rate_sweep(config, rates)
    for comparison in sweep:
        echo(format_comparison(comparison.metrics(),
                               f"{config.url}: {comparison.request_rate:g} req/s,"
                               f" {config.num_prompts} requests per policy,"
                               f" {config.max_tokens} output tokens"))
    source = " ".join(filter(None, (live_shape(sweep[0].info), "live"))) + f", {config.url}"
    for path in write_plots(sweep, config.result_dir, source):
        echo(f"plot: {path}")
    echo(f"results: {config.result_dir}")
