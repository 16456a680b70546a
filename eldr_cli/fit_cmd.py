"""`eldr fit`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from eldr_cli.options import SeedOption
from stages import paths

if TYPE_CHECKING:
    from stages.routing.cost_model import CostModel


def fit(
    k: Annotated[int, typer.Option("--k", help="Clusters = decode workers the artifact serves.",
                                   min=1)] = 20,
    balanced: Annotated[bool, typer.Option(
        "--balanced/--no-balanced",
        help="Balanced clusters (sizes differ by at most one) or plain spherical k-means.")
    ] = True,
    data: Annotated[Path | None, typer.Option(
        help="Signature dataset from `eldr capture`. Default: $ELDR_HOME/signatures.zarr.",
        show_default=False)] = None,
    store: Annotated[Path | None, typer.Option(
        help="Artifact store. Default: $ELDR_HOME/artifacts.", show_default=False)] = None,
    seed: SeedOption = 0,
    plot: Annotated[bool, typer.Option(help="Write a PNG of cluster sizes and the layer-mask"
                                       " search next to the artifact.")] = True,
    cost: Annotated[str, typer.Option(
        help="Cost model for the predicted TPOT change: 'gpu' (GPU-like preset, as `eldr bench"
        " --simulate` by default), 'cpu', or a JSON file from `eldr bench --engine-cost`.")
    ] = "gpu",
    decode_batch: Annotated[str | None, typer.Option(
        "--decode-batch",
        help="Decode batch sizes to estimate the per-step gain at, comma separated, e.g."
        " 8,16,32: those your decode workers run. Default: 4,8,16,32.",
        show_default=False)] = None,
    dial: Annotated[bool, typer.Option(
        "--dial/--no-dial",
        help="Place the data on the locality dial (the blend strength whose cross-fitted gain"
        " equals yours) and simulate 8P16D there: eldr-union's TPOT over the best load balancer"
        " with its interval over 5 short runs. A few seconds; stored with the artifact.")
    ] = True,
    dial_data: Annotated[Path | None, typer.Option(
        help="--dial: the signature dataset to build the dial on, of the same model; another"
        " dataset costs a second fit on it. Default: $ELDR_HOME/signatures.zarr (what `eldr"
        " bench --simulate` sweeps) if it holds this model's signatures, else --data.",
        show_default=False)] = None,
) -> None:
    """Fit the signature transform (IDF, layer mask) and balanced spherical k-means centroids,
    and save them as an immutable, content-addressed artifact version. Prints what routing by
    centroid should buy per decode step, estimated on every request with centroids fit without
    it (cross-fit), the TPOT change it predicts, and where the data sits on the locality dial
    with what a simulated cluster gives there."""
    from stages.fit.fit_dataset import fit_dataset
    from stages.fit.gain import GainConfig
    from stages.fit.pipeline import FitConfig
    from stages.routing.cost_model import cost_model_for

    gain = GainConfig() if decode_batch is None else GainConfig(batch_sizes=_batch_sizes(
        decode_batch))
    data = data or paths.default_dataset()
    runner = None
    if dial:
        from stages.bench.sim.fit_dial import choose_dial_data, fit_dial

        runner = fit_dial(choose_dial_data(data, dial_data), progress=typer.echo)
    elif dial_data is not None:
        raise typer.BadParameter("--dial-data builds the dial: drop --no-dial",
                                 param_hint="'--dial-data'")
    typer.echo(_local_prefill_line(cost_model_for(cost, 1, 8), cost, gain.batch_sizes))
    fit_dataset(data, store or paths.default_artifact_store(),
                FitConfig(k=k, balanced=balanced, seed=seed, gain=gain), cost, plot,
                echo=typer.echo, warn=lambda line: typer.echo(line, err=True),
                cost_model_for=cost_model_for, dial=runner)


def _local_prefill_line(cost_model: CostModel, spec: str, batch_sizes: tuple[int, ...]) -> str:
    """eldr-kv's ``local_prefill_below`` the costs give at each decode batch size; the one at
    the largest batch stalls no batch listed for longer than the remote path takes."""
    from stages.routing.local_prefill import default_local_prefill_below

    sizes = sorted(set(batch_sizes))
    found = [default_local_prefill_below(cost_model, b) for b in sizes]
    each = ", ".join(f"{'no bound' if n is None else n} at a decode batch of {b}"
                     for b, n in zip(sizes, found, strict=True))
    safe = found[-1]
    advice = ("" if safe is None else f"; for decode batches up to {sizes[-1]}: --policy-config"
              f" '{{\"eldr-kv\": {{\"local_prefill_below\": {safe}}}}}'")
    return (f"conditional disaggregation (eldr-kv's local_prefill_below, prompt tokens a decode"
            f" worker may lack and prefill itself) from the {cost_model.name} costs (--cost"
            f" {spec}): {each}{advice}")


def _batch_sizes(text: str) -> tuple[int, ...]:
    """``--decode-batch`` parsed; a bad value is a usage error (exit 2), as Typer's own."""
    from stages.errors import EldrError
    from stages.fit.gain import parse_batch_sizes

    try:
        return parse_batch_sizes(text)
    except EldrError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--decode-batch'") from exc
