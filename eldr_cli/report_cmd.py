"""`eldr report`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def report(
    inputs: Annotated[list[Path] | None, typer.Argument(
        metavar="PATHS",
        help="Results folders from `eldr bench` (--result-dir) and artifact stores or version"
        " folders from `eldr fit`. Default: every results folder under $ELDR_HOME/results,"
        " newest first, and the latest artifact in $ELDR_HOME/artifacts.",
        show_default=False)] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="The HTML file to write.")]
    = Path("report.html"),
) -> None:
    """Write one self-contained HTML page (plots inlined, no scripts, nothing fetched) with
    the fit's verdict, the locality dial, the live and simulated tables, the plots, and the
    eldr and vLLM versions and commands that produced each."""
    from stages.report.inputs import gather
    from stages.report.page import render

    gathered = gather(inputs or [])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(gathered), encoding="utf-8")
    tables = sum(len(f.tables) + len(f.dials) for f in gathered.folders)
    plots = sum(len(f.plots) for f in gathered.folders) + sum(
        f.plot is not None for f in gathered.fits)
    typer.echo(f"report: {out} ({len(gathered.folders)} results folders, {tables} tables,"
               f" {plots} plots, {len(gathered.fits)} artifacts)")
