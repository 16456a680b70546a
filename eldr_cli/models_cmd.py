"""`eldr models`."""

from __future__ import annotations

import typer

from stages.models import PRESETS, hub_cache_status


def models() -> None:
    """List model presets, what they are and whether their weights are on this machine."""
    for preset in PRESETS.values():
        if preset.hub_id is None:
            status = "bundled" + (", derived at first use" if preset.derived else "")
        else:
            status = f"{preset.hub_id}: {hub_cache_status(preset.hub_id)}"
        typer.echo(f"{preset.name:10s} {preset.description}  [{status}]")
