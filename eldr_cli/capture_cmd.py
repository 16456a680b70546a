"""`eldr capture`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from eldr_cli.options import EagerOption, ModelOption, SeedOption
from stages import paths


def capture(
    model: ModelOption = "tiny",
    prompts: Annotated[
        Path | None,
        typer.Option(help="JSONL prompts {id, prompt, domain}. Default: the bundled calibration"
                     " split.", show_default=False),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="zarr dataset to create or append to. Default: $ELDR_HOME/"
                     "signatures.zarr.", show_default=False),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt (decode profile).",
                                            min=1)] = 32,
    limit: Annotated[int | None, typer.Option(help="Capture only the first N prompts.", min=1)]
    = None,
    batch_size: Annotated[int, typer.Option(help="Prompts per batch (each batch is saved).",
                                            min=1)] = 64,
    enforce_eager: EagerOption = False,
    seed: SeedOption = 0,
) -> None:
    """Run prompts through vLLM with eldr's plugin and store each request's prefill signature
    and decode-time expert counts. Re-running resumes: stored ids are skipped."""
    from stages.capture.runner import CaptureConfig
    from stages.capture.runner import capture as run_capture
    from stages.models import resolve_model
    from stages.prompts import load_prompts

    items = load_prompts(prompts or paths.CALIBRATION_PROMPTS)
    resolved = resolve_model(model)
    if limit is not None:
        items = items[:limit]
    out = out or paths.default_dataset()
    typer.echo(f"capturing {len(items)} prompts with {resolved.identity.describe()} -> {out}")
    with tqdm(total=len(items), unit="prompt", desc="capture") as bar:
        summary = run_capture(
            resolved, items, out, CaptureConfig(max_tokens=max_tokens, batch_size=batch_size,
                                                seed=seed, enforce_eager=enforce_eager),
            progress=bar.update,
        )
    typer.echo(
        f"stored {summary.captured} new signatures ({summary.skipped} already there);"
        f" {summary.total} in {summary.path}"
    )
