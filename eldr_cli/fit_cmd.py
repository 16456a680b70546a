"""`eldr fit`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eldr_cli.options import SeedOption
from stages import paths


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
) -> None:
    """Fit the signature transform (IDF, layer mask) and balanced spherical k-means centroids,
    and save them as an immutable, content-addressed artifact version. Prints what routing by
    centroid should buy per decode step on held-out requests, and the TPOT change it predicts."""
    from stages.errors import EldrError
    from stages.fit.artifact import ArtifactStore
    from stages.fit.fit_plot import plot_fit
    from stages.fit.gain_report import gain_lines
    from stages.fit.pipeline import FitConfig, fit_artifact
    from stages.routing.cost_model import cost_model_for
    from stages.signature.dataset import SignatureDataset

    dataset = SignatureDataset.open(data or paths.default_dataset())
    arrays = dataset.read()
    if len(arrays) < 2 * k:
        raise EldrError(
            f"{dataset.path} holds {len(arrays)} signatures; fitting k={k} clusters needs at"
            f" least {2 * k} (capture more prompts or lower --k)"
        )
    identity = dataset.identity
    try:
        step_cost = cost_model_for(cost, identity.num_layers, identity.num_experts)
    except EldrError as exc:
        if cost != "gpu":
            raise
        # The default preset cannot describe every model (it needs 8+ experts): estimate the
        # expert counts anyway and say why there is no TPOT column.
        typer.echo(f"no TPOT estimate: {exc} (pass --cost cpu or a fitted JSON)", err=True)
        step_cost = None
    artifact_store = ArtifactStore(store or paths.default_artifact_store())
    typer.echo(f"fitting k={k} ({'balanced' if balanced else 'unbalanced'}) on {len(arrays)}"
               f" signatures of {identity.describe()}")
    artifact = fit_artifact(
        arrays.prefill_counts, arrays.decode_counts, identity, dataset.content_hash(),
        FitConfig(k=k, balanced=balanced, seed=seed), artifact_store, progress=typer.echo,
        cost=step_cost,
    )
    typer.echo(f"artifact {artifact.version} saved in {artifact_store.root} (now 'latest')")
    for key, value in artifact.metrics.items():
        if isinstance(value, (int, float, str)):
            typer.echo(f"  {key}: {value}")
    for warning in artifact.metrics["warnings"]:
        typer.echo(f"warning: {warning}", err=True)
    if step_cost is not None:
        default = ", the preset `eldr bench --simulate` uses by default" if cost == "gpu" else ""
        typer.echo(f"TPOT from the {step_cost.name} cost model (--cost {cost}{default}), at a"
                   " steady decode batch of each size")
    for line in gain_lines(artifact.metrics["expected_gain"], k):
        typer.echo(line)
    if plot:
        png = artifact_store.root / artifact.version / "fit.png"
        plot_fit(artifact, png)
        typer.echo(f"  plot: {png}")
