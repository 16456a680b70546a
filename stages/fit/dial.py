"""The locality dial as `eldr fit` sees it: what a fit hands the dial, and the one line it
prints of the dial's answer.

The dial itself (``stages.bench.sim.fit_dial``) blends a dataset's decode from its own (s = 0)
to another request's (s = 1, no locality), places the fitted data where the blended dataset's
cross-fitted gain equals the fit's, and simulates a cluster there. It lives with the simulator;
the fit only calls it through ``DialHook``, so this stage never imports the bench's. What it
returns is stored as the artifact's ``dial`` metric, so `eldr artifacts show --gain` (and
`eldr report`) read the same line back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from stages.signature.dataset import ModelIdentity, SignatureArrays

if TYPE_CHECKING:
    from stages.fit.config import FitConfig
    from stages.fit.gain import StepTimeModel


@dataclass(frozen=True, eq=False)
class DialInput:
    """What a fit knows when the dial runs: before its artifact is saved."""

    identity: ModelIdentity
    dataset_hash: str
    config: FitConfig
    labels: np.ndarray  # [n] each request's out-of-fold cluster (the cross-fit's)
    expected_gain: dict[str, Any]  # the cross-fitted gain, as the artifact stores it
    cost: StepTimeModel | None  # the fit's --cost, None where it has none for this model


# The dial's answer for the artifact's metrics (JSON-ready).
DialHook = Callable[[DialInput], dict[str, Any]]
# The same, given the fitted dataset's arrays first (the simulator needs the whole rows).
DialRunner = Callable[[SignatureArrays, DialInput], dict[str, Any]]


def dial_line(dial: dict[str, Any]) -> str:
    """Where the data sits on the dial and the simulated TPOT there, or why it does not."""
    if "skipped" in dial:
        return f"dial: cannot place your data: {dial['skipped']}"
    gain = (f"{dial['agreement']:.1%} fewer distinct experts per step at batch"
            f" {dial['batch_size']}, cross-fit")
    if dial["own_data"]:
        where = f"dial: your data is the dial's s = 0 (the dial is built on it; {gain})"
    else:
        where = (f"dial: your data ({gain}) sits at s = {dial['strength']:.2f} on the dial of"
                 f" {dial['data']}")
    if dial.get("note"):
        where += f" ({dial['note']})"
    sim = dial["simulation"]
    if "skipped" in sim:
        return f"{where}; no simulated cluster: {sim['skipped']}"
    p50, p99 = (sim[key] for key in ("median_tpot_ms_over_best_balancer",
                                     "p99_tpot_ms_over_best_balancer"))
    line = (
        f"{where}; the simulated {sim['cluster']} cluster there ({sim['cost_model']} cost,"
        f" {sim['load']:.0%} of capacity, {len(sim['seeds'])} seeds x ~{sim['requests']}"
        f" requests): {sim['policy']} TPOT p50 {_ratio(p50)}, p99 {_ratio(p99)} of the best"
        f" load balancer ({sim['confidence']:.0%} intervals over the seeds)"
    )
    if sim.get("warning"):
        line += f"; {sim['warning']}"
    return line


def _ratio(figure: dict[str, Any]) -> str:
    lo, hi = figure["interval"]
    return f"{figure['mean']:.2f}x [{lo:.2f}, {hi:.2f}]"
