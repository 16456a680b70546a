"""`eldr capture`."""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from eldr_cli.options import EagerOption, ModelOption, SeedOption
from stages import paths
from stages.engine import tail
from stages.errors import EldrError
from stages.output_redirect import output_to_file


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
    tensor_parallel_size: Annotated[int, typer.Option(
        "--tensor-parallel-size", "-tp", min=1,
        help="vLLM --tensor-parallel-size: one engine over this many GPUs (on CPU, one core"
        " per rank). Signatures equal a single-rank engine's.")] = 1,
    seed: SeedOption = 0,
) -> None:
    """Run prompts through vLLM with eldr's plugin and store each request's prefill signature
    and decode-time expert counts. Re-running resumes: stored ids are skipped."""
    from stages.capture.runner import CaptureConfig, EngineProbe
    from stages.capture.runner import capture as run_capture
    from stages.models import resolve_model
    from stages.prompts import load_prompts
    from stages.serve.proxy.ops.self_check import PROBE_PROMPT, check_signature

    items = load_prompts(prompts or paths.CALIBRATION_PROMPTS)
    resolved = resolve_model(model)
    if limit is not None:
        items = items[:limit]
    out = out or paths.default_dataset()
    log_path = paths.eldr_home() / "logs" / f"capture-{time.strftime('%Y%m%d-%H%M%S')}.log"
    typer.echo(f"capturing {len(items)} prompts with {resolved.identity.describe()} -> {out}")
    typer.echo(f"vLLM's output goes to {log_path}")
    config = CaptureConfig(max_tokens=max_tokens, batch_size=batch_size, seed=seed,
                           enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size)
    with output_to_file(log_path) as console:
        try:
            with tqdm(total=len(items), unit="prompt", desc="capture", file=console) as bar:
                summary = run_capture(resolved, items, out, config,
                                      EngineProbe(PROBE_PROMPT, check_signature),
                                      progress=bar.update, status=bar.set_description_str)
        except EldrError:
            raise
        except Exception as exc:
            traceback.print_exc()  # into the log, beside vLLM's own account of the failure
            sys.stderr.flush()
            raise EldrError(
                f"capture failed ({exc.__class__.__name__}: {exc}); signatures stored so far are"
                f" kept. Last lines of {log_path}:\n{tail(log_path)}"
            ) from exc
    typer.echo(
        f"stored {summary.captured} new signatures ({summary.skipped} already there);"
        f" {summary.total} in {summary.path}"
    )
