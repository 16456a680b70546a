"""NIXL's UCX progress thread, off on CPU workers eldr starts.

vLLM's NixlConnector creates its NIXL agent with NIXL's default ``enable_prog_thread=True``.
On CPU that thread polls without rest: about one core per prefill or decode worker, idle or
not, measured here (a bare agent: 0.4-1.0 core idle with it, 0.0 without). On a machine with
a few cores that is most of the machine, and every worker's compute and start-up slows down.
vLLM's connector progresses transfers itself on every step (``check_xfer_state``, reading
notifications), so eldr turns the thread off where it starts CPU workers
(``ELDR_NIXL_PROGRESS_THREAD=0``, set by ``stages.engine``); GPU workers, and any engine
without that variable, keep NIXL's default.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

from stages.engine import NIXL_PROGRESS_ENV as ENV

log = logging.getLogger(__name__)


def apply_progress_thread_choice() -> bool:
    """Patch the NIXL agent config vLLM builds when ``ELDR_NIXL_PROGRESS_THREAD=0``; returns
    whether it did."""
    if os.environ.get(ENV) != "0":
        return False
    import vllm.distributed.nixl_utils as nixl_utils

    original = getattr(nixl_utils, "nixl_agent_config", None)
    if original is None or getattr(original, "_eldr_no_progress_thread", False):
        return False

    @functools.wraps(original)
    def without_progress_thread(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_prog_thread", False)
        return original(*args, **kwargs)

    without_progress_thread._eldr_no_progress_thread = True  # type: ignore[attr-defined]
    nixl_utils.nixl_agent_config = without_progress_thread
    # The connector binds the name when it is imported; one imported already is patched too.
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.distributed.kv_transfer") and \
                getattr(module, "nixl_agent_config", None) is original:
            module.nixl_agent_config = without_progress_thread  # type: ignore[attr-defined]
    return True
