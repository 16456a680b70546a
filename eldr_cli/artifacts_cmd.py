"""`eldr artifacts list|show`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from stages import paths

app = typer.Typer(no_args_is_help=True)
StoreOption = Annotated[
    Path | None,
    typer.Option(help="Artifact store. Default: $ELDR_HOME/artifacts.", show_default=False),
]


@app.command("list")
def list_artifacts(store: StoreOption = None) -> None:
    """List artifact versions, newest first; '*' marks 'latest'."""
    from stages.fit.artifact import ArtifactStore

    summaries = ArtifactStore(store or paths.default_artifact_store()).list()
    if not summaries:
        typer.echo("no artifacts yet; run `eldr fit`")
        return
    for s in summaries:
        typer.echo(s.describe())


@app.command("show")
def show(
    version: Annotated[str, typer.Argument(help="Version (or 'latest').")] = "latest",
    store: StoreOption = None,
    gain: Annotated[bool, typer.Option(
        "--gain", help="Print only the per-step gain estimate and the locality dial line `eldr"
        " fit` printed, as text.")
    ] = False,
) -> None:
    """Print an artifact's model identity, fit parameters and metrics as JSON."""
    from dataclasses import asdict

    from stages.errors import EldrError
    from stages.fit.artifact import ArtifactStore
    from stages.fit.dial import dial_line
    from stages.fit.gain_report import gain_lines

    artifact = ArtifactStore(store or paths.default_artifact_store()).load(version)
    if gain:
        estimate = artifact.metrics.get("expected_gain")
        if estimate is None:
            raise EldrError(f"artifact {artifact.version} predates the gain estimate; refit it"
                            " with `eldr fit`")
        for line in gain_lines(estimate, artifact.num_clusters):
            typer.echo(line)
        if "dial" in artifact.metrics:
            typer.echo(dial_line(artifact.metrics["dial"]))
        return
    typer.echo(json.dumps({
        "version": artifact.version,
        "created": artifact.created,
        "identity": asdict(artifact.identity),
        "dataset_hash": artifact.dataset_hash,
        "centroids": list(artifact.centroids.shape),
        "layer_mask": artifact.transform.layer_mask.astype(int).tolist(),
        "params": artifact.params,
        "metrics": artifact.metrics,
    }, indent=2, default=str))
