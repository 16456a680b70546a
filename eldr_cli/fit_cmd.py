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
    from stages.fit.fit_dataset import fit_dataset
    from stages.fit.pipeline import FitConfig

    fit_dataset(data or paths.default_dataset(), store or paths.default_artifact_store(),
                FitConfig(k=k, balanced=balanced, seed=seed), cost, plot, echo=typer.echo,
                warn=lambda line: typer.echo(line, err=True))
