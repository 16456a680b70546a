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
) -> None:
    """Fit the signature transform (IDF, layer mask) and balanced spherical k-means centroids,
    and save them as an immutable, content-addressed artifact version."""
    from stages.fit.artifact import ArtifactStore
    from stages.fit.pipeline import FitConfig, fit_artifact, plot_fit
    from stages.signature.dataset import SignatureDataset

    dataset = SignatureDataset.open(data or paths.default_dataset())
    arrays = dataset.read()
    if len(arrays) < 2 * k:
        from stages.errors import EldrError

        raise EldrError(
            f"{dataset.path} holds {len(arrays)} signatures; fitting k={k} clusters needs at"
            f" least {2 * k} (capture more prompts or lower --k)"
        )
    artifact_store = ArtifactStore(store or paths.default_artifact_store())
    typer.echo(f"fitting k={k} ({'balanced' if balanced else 'unbalanced'}) on {len(arrays)}"
               f" signatures of {dataset.identity.describe()}")
    artifact = fit_artifact(
        arrays.prefill_counts, arrays.decode_counts, dataset.identity, dataset.content_hash(),
        FitConfig(k=k, balanced=balanced, seed=seed), artifact_store, progress=typer.echo,
    )
    typer.echo(f"artifact {artifact.version} saved in {artifact_store.root} (now 'latest')")
    for key, value in artifact.metrics.items():
        if isinstance(value, (int, float, str)):
            typer.echo(f"  {key}: {value}")
    if plot:
        png = artifact_store.root / artifact.version / "fit.png"
        plot_fit(artifact, png)
        typer.echo(f"  plot: {png}")
