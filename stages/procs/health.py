"""Whether a server eldr started answers ``GET /health`` with 200, once or until a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from stages.errors import EldrError


def healthy(url: str, timeout_s: float = 1.0) -> bool:
    """``url``/health answered 200; refused, timed out or any other status is False."""
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, timeout_s: float, exit_code: Callable[[], int | None],
                 interval_s: float = 0.5) -> None:
    """Return once ``url`` is healthy; raise EldrError if the process behind it exits first
    (``exit_code`` is not None) or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (code := exit_code()) is not None:
            raise EldrError(f"the server for {url} exited with code {code} before it was ready")
        if healthy(url):
            return
        time.sleep(interval_s)
    raise EldrError(f"{url} not healthy after {timeout_s:.0f} s")
