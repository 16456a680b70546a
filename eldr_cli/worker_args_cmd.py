"""`eldr worker-args`: the vLLM flags a worker you start yourself needs for eldr."""

from __future__ import annotations

import json
import shlex
from typing import Annotated

import typer


def worker_args(
    role: Annotated[str, typer.Argument(help="prefill, decode, or plain (no PD hand-off).")]
    = "decode",
    publish_batch: Annotated[str | None, typer.Option(
        help="decode: publish the running batch on this ZMQ endpoint (e.g."
        " tcp://10.0.0.5:5600, a private address: every request id and signature goes out on"
        " it), for several proxies in front of the worker (eldr serve --attach-batch).",
        show_default=False)] = None,
    kv_events: Annotated[str | None, typer.Option(
        help="Publish vLLM's KV events on this ZMQ endpoint (tcp://*:PORT binds every"
        " interface and replays on PORT+1; ipc://PATH replays on PATH.replay), for KV-aware"
        " routing (eldr serve --attach-kv-events, with the address the proxy reaches).",
        show_default=False)] = None,
) -> None:
    """Print the `vllm serve` flags that make a worker record signatures for eldr (use with
    `eldr serve --attach-prefill/--attach-decode`). vLLM's default compiled mode is fine."""
    from stages.engine import kv_transfer_config
    from stages.errors import EldrError

    if role not in ("prefill", "decode", "plain"):
        raise EldrError(f"role must be prefill, decode or plain, not {role!r}")
    if publish_batch is not None and (role != "decode" or not publish_batch.startswith("tcp://")):
        raise EldrError("--publish-batch is a decode worker's tcp:// endpoint, e.g."
                        " tcp://*:5600")
    config = json.dumps(kv_transfer_config(role, publish_batch=publish_batch),
                        separators=(",", ":"))
    line = f"--kv-transfer-config {shlex.quote(config)}"
    if kv_events is not None:
        from stages.routing.kv.endpoints import kv_events_config

        events = json.dumps(kv_events_config(kv_events), separators=(",", ":"))
        line += f" --kv-events-config {shlex.quote(events)}"
    typer.echo(line)
