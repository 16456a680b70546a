"""The ``eldr`` command: thin Typer commands over the typed functions in ``stages``.

Every command works with no options (bundled model, bundled prompts, default paths under
``$ELDR_HOME`` or ``./.eldr``). A user mistake ends with a one-line message and exit code 2,
never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from eldr_cli import (
    artifacts_cmd,
    bench_cmd,
    capture_cmd,
    fit_cmd,
    models_cmd,
    report_cmd,
    serve_cmd,
    worker_args_cmd,
)
from stages.errors import EldrError

app = typer.Typer(
    name="eldr",
    help=(
        "Expert-locality-aware decode routing for MoE models on vLLM.\n\n"
        "Pipeline: `eldr capture` (expert signatures) -> `eldr fit --k 20 --balanced`"
        " (centroids) -> `eldr serve` (PD workers + routing proxy) -> `eldr bench`."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command("capture", help="Record expert signatures of prompts with real vLLM into zarr.")(
    capture_cmd.capture
)
app.command("fit", help="Cluster signatures into balanced centroids; save a versioned artifact.")(
    fit_cmd.fit
)
app.command("serve", help="Start vLLM prefill/decode workers behind the routing proxy.")(
    serve_cmd.serve
)
app.command("bench", help="Compare routing policies on the live proxy, or simulate a cluster.")(
    bench_cmd.bench
)
app.command("report", help="Write the results and the fit's verdict as one shareable HTML page.")(
    report_cmd.report
)
app.add_typer(artifacts_cmd.app, name="artifacts", help="List and inspect fitted artifacts.")
app.command("models", help="List model presets and whether their weights are available.")(
    models_cmd.models
)
app.command("worker-args", help="Print the vLLM flags your own workers need for eldr.")(
    worker_args_cmd.worker_args
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from stages.vllm_compat import installed_vllm

        typer.echo(f"eldr {version('eldr')}, vLLM {installed_vllm() or 'not installed'}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True,
                     help="Print eldr's and vLLM's versions and exit."),
    ] = False,
    home: Annotated[
        Path | None,
        typer.Option("--home", envvar="ELDR_HOME", help="Where datasets, artifacts and results"
                     " live (default ./.eldr).", show_default=False),
    ] = None,
) -> None:
    if home is not None:
        import os

        os.environ["ELDR_HOME"] = str(home)


def main() -> None:
    try:
        app()
    except EldrError as exc:
        typer.secho(f"eldr: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.secho("eldr: interrupted", err=True)
        sys.exit(130)
