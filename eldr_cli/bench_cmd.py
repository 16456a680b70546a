"""`eldr bench` (wired to stages.bench below)."""

from __future__ import annotations


def bench() -> None:
    """Compare routing policies on the live proxy, or simulate a cluster."""
    from stages.errors import EldrError

    raise EldrError("eldr bench is being wired up")
