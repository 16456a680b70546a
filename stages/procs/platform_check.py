"""Where eldr can own processes: Linux only (the keeper and the watchdog use prctl, pidfds and
/proc). Elsewhere eldr says so before starting anything instead of failing half-way."""

from __future__ import annotations

import logging
import sys

from stages.errors import EldrError

log = logging.getLogger(__name__)


def owns_processes() -> bool:
    return sys.platform.startswith("linux")


def require_process_ownership() -> None:
    """``eldr serve`` starting workers: refused off Linux, naming what works there."""
    if not owns_processes():
        raise EldrError(
            f"eldr serve starts and supervises vLLM workers with Linux process controls (prctl,"
            f" pidfd), which {sys.platform} lacks. Start the workers yourself (`eldr worker-args"
            " prefill` / `decode` prints their flag) and run only the proxy: eldr serve"
            " --attach-prefill URL --attach-decode URL"
        )
