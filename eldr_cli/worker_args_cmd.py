"""`eldr worker-args`: the vLLM flags a worker you start yourself needs for eldr."""

from __future__ import annotations

import json
import shlex
from typing import Annotated

import typer


def worker_args(
    role: Annotated[str, typer.Argument(help="prefill, decode, or plain (no PD hand-off).")]
    = "decode",
) -> None:
    """Print the `vllm serve` flags that make a worker record signatures for eldr (use with
    `eldr serve --attach-prefill/--attach-decode`). vLLM's default compiled mode is fine."""
    from stages.engine import kv_transfer_config
    from stages.errors import EldrError

    if role not in ("prefill", "decode", "plain"):
        raise EldrError(f"role must be prefill, decode or plain, not {role!r}")
    config = json.dumps(kv_transfer_config(role), separators=(",", ":"))
    typer.echo(f"--kv-transfer-config {shlex.quote(config)}")
