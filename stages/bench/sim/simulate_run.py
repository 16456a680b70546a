"""`eldr bench --simulate`: policies compared on a simulated PD cluster, at one or more
request rates, or along the locality dial at one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from stages import paths
from stages.errors import EldrError
from stages.routing.policies import needs_centroids
from stages.routing.policy_config import PolicyConfig

if TYPE_CHECKING:
    from stages.bench.sim.simulator import SimConfig
    from stages.fit.artifact import Artifact
    from stages.signature.dataset import SignatureArrays, SignatureDataset


@dataclass(frozen=True)
class SimulateOptions:
    """What `eldr bench --simulate` was asked for (without --replay)."""

    policies: tuple[str, ...]
    result_dir: Path
    data: Path | None = None  # default: $ELDR_HOME/signatures.zarr
    store: Path | None = None  # default: $ELDR_HOME/artifacts
    request_rate: str = "2"  # req/s, 'N%' of capacity or 'auto', comma separated
    prefill: int = 8
    decode: int = 16
    duration: float = 120.0
    cost: str = "gpu"
    output_tokens: int | None = None
    seed: int = 0
    locality_blend: str = "0"
    locality_reference: Path | None = None
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # Also simulate the requests the artifact's centroids were fit on (by default only the
    # ones it held out, when it was fit on this dataset).
    include_fit_rows: bool = False
    # Routing proxies in front of the decode workers, each seeing the others' assignments
    # only once the workers publish them, publish_delay_ms later (``SimConfig.proxies``).
    proxies: int = 1
    publish_delay_ms: float = 0.0


# Fewer distinct requests than this, drawn over a whole simulation, repeat so often that
# requests identical to one another share their experts exactly.
SMALL_DATASET = 500


def unseen_requests(arrays: SignatureArrays, artifact: Artifact | None, dataset_hash: str,
                    include_fit_rows: bool) -> tuple[SignatureArrays, list[str]]:
    """The rows to simulate, and what to tell the user about them. A simulation that draws the
    very requests the centroids were fit on tests them on their training data."""
    from stages.bench.sim.locality_blend import take_rows
    from stages.fit.pipeline import held_out_rows

    notes = []
    pool = arrays
    if artifact is not None and artifact.dataset_hash == dataset_hash and not include_fit_rows:
        held = held_out_rows(artifact.params, len(arrays))
        if held is None or held.size == 0:
            notes.append(f"warning: artifact {artifact.version} was fit on every row of this"
                         " dataset: the simulation tests its centroids on their training rows")
        else:
            pool = take_rows(arrays, held)
            notes.append(f"simulating the {held.size} requests artifact {artifact.version}"
                         f" held out of its fit (of {len(arrays)}; --include-fit-rows for all)")
    if len(pool) < SMALL_DATASET:
        notes.append(f"warning: {len(pool)} distinct requests, each drawn many times: repeats"
                     " of one request share its experts exactly, which flatters every policy"
                     " that groups similar requests; capture more prompts for figures that"
                     " hold")
    return pool, notes


def _proxies_info(config: SimConfig) -> dict[str, object]:
    """The routing proxies a simulation modelled, as its result files record them."""
    return {"proxies": config.proxies, "publish_delay_ms": 1000.0 * config.publish_delay_s}


def _proxies_label(config: SimConfig) -> str:
    if config.proxies == 1:
        return ""
    delay_ms = 1000.0 * config.publish_delay_s
    return f" behind {config.proxies} proxies ({delay_ms:g} ms publish delay)"


def run_simulate(o: SimulateOptions, echo: Callable[[str], None]) -> None:
    """Simulate ``o``'s cluster on the stored signatures at each request rate (or sweep the
    locality dial at one), print each comparison and write its results and plots."""
    from stages.bench.plots import write_plots
    from stages.bench.report import format_comparison
    from stages.bench.results import ComparisonResult, save_comparison
    from stages.bench.sim.capacity import cluster_capacity, parse_rates, resolve_rates
    from stages.bench.sim.locality_sweep import parse_strengths
    from stages.bench.sim.simulator import SimConfig, simulate
    from stages.fit.artifact import load_for_serving
    from stages.routing.cost_model import cost_model_for
    from stages.signature.dataset import SignatureDataset

    prefill, decode, duration, output_tokens = o.prefill, o.decode, o.duration, o.output_tokens
    specs = parse_rates(o.request_rate)
    strengths = parse_strengths(o.locality_blend)
    if len(strengths) > 1 and len(specs) != 1:
        raise EldrError("a locality sweep (several --locality-blend values) runs at one"
                        " --request-rate")
    dataset = SignatureDataset.open(o.data or paths.default_dataset())
    arrays = dataset.read()
    identity = dataset.identity
    artifact = None
    if any(needs_centroids(name) for name in o.policies):
        artifact = load_for_serving(o.store or paths.default_artifact_store(), "latest", identity,
                                    decode)
    pool, notes = unseen_requests(arrays, artifact, dataset.content_hash(), o.include_fit_rows)
    for note in notes:
        echo(note)
    model = cost_model_for(o.cost, identity.num_layers, identity.num_experts)
    base = SimConfig(cost=model, num_prefill=prefill, num_decode=decode, duration_s=duration,
                     policies=o.policies, output_tokens=output_tokens,
                     max_output_tokens=max(512, output_tokens or 0), seed=o.seed,
                     locality_blend=strengths[0], policy_config=o.policy_config,
                     proxies=o.proxies, publish_delay_s=o.publish_delay_ms / 1000.0)
    capacity = None
    if any(s.of_capacity for s in specs):
        capacity = cluster_capacity(
            model, pool, identity.top_k, num_prefill=prefill, num_decode=decode,
            max_batch=base.max_batch, output_tokens=output_tokens,
            max_output_tokens=base.max_output_tokens,
            first_token_from_prefill=base.first_token_from_prefill)
    rates = resolve_rates(specs, capacity)
    if capacity is not None:
        chosen = ", ".join(f"{r:g}" + (f" ({s.value:.0%})" if s.of_capacity else "")
                           for s, r in zip(specs, rates, strict=True))
        echo(f"request rates {chosen} req/s: {capacity.describe()}")
    source = (f"{prefill}P{decode}D simulated{_proxies_label(base)}, cost {model.name},"
              f" {identity.name}")
    if len(strengths) > 1:
        _locality_sweep(replace(base, request_rate=rates[0]), dataset, arrays, pool, artifact,
                        strengths, identity.top_k, o.locality_reference, source, o.result_dir,
                        echo)
        return
    blend = f", locality blend s={strengths[0]:g}" if strengths[0] else ""
    sweep = []
    for rate in rates:
        config = replace(base, request_rate=rate)
        comparison = ComparisonResult(rate, simulate(config, pool, artifact,
                                                     top_k=identity.top_k), _proxies_info(base))
        sweep.append(comparison)
        save_comparison(comparison, o.result_dir)
        echo(format_comparison(
            comparison.metrics(), f"simulated {prefill}P{decode}D{_proxies_label(base)},"
            f" {rate:g} req/s, {duration:g} s, {model.name} cost, {identity.describe()}{blend}"))
    for path in write_plots(sweep, o.result_dir, source + blend, prefix="sim-"):
        echo(f"plot: {path}")


def _locality_sweep(config: SimConfig, dataset: SignatureDataset, arrays: SignatureArrays,
                    pool: SignatureArrays, artifact: Artifact | None, strengths: list[float],
                    top_k: int, reference_store: Path | None, source: str, result_dir: Path,
                    echo: Callable[[str], None]) -> None:
    import orjson

    from stages.bench.results import rate_label
    from stages.bench.sim.dial_plot import plot_locality_dial
    from stages.bench.sim.locality_sweep import (
        format_dial,
        locality_gauge,
        requests_per_policy,
        run_locality_sweep,
        sweep_json,
    )
    from stages.fit.artifact import ArtifactStore
    from stages.provenance import provenance

    gauge = None
    if artifact is not None:
        reference = artifact
        name = f"eldr fit {artifact.version} of the simulated data"
        if reference_store is not None:
            reference = ArtifactStore(reference_store).load("latest")
            name = f"eldr fit {reference.version} in {reference_store}"
        gauge = locality_gauge(artifact, dataset.content_hash(), len(arrays), reference, name)
    sweep = run_locality_sweep(config, arrays, artifact, strengths, top_k=top_k, gauge=gauge,
                               simulated=pool)
    rate = rate_label(config.request_rate)
    requests = requests_per_policy(sweep.comparisons[0])
    echo(f"locality dial, {source}, {rate} req/s, {config.duration_s:g} s,"
               f" {requests} requests per policy")
    echo(format_dial(sweep))
    result_dir.mkdir(parents=True, exist_ok=True)
    # Not Path.with_suffix: a rate such as 4.12 has a dot of its own.
    numbers = result_dir / f"sim-locality-dial-{rate}qps.json"
    doc = sweep_json(sweep, {"source": source, "duration_s": config.duration_s,
                             "seed": config.seed, **_proxies_info(config), **provenance()})
    numbers.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    plot = plot_locality_dial(sweep, result_dir / f"sim-locality-dial-{rate}qps.png",
                              title=f"{source}: locality dial at {rate} req/s,"
                              f" {requests} requests per policy per point")
    echo(f"plot: {plot}")
    echo(f"numbers: {numbers}")
