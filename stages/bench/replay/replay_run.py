"""Replay a live run in the simulator: its requests, cluster and core plan, beside its figures.

The simulated cluster is the live one: its prefill and decode workers, their batch slots
(``eldr serve``'s --max-num-seqs default; the results do not record it), the load
generator's concurrency cap, the artifact and policy options the proxy reported, and the
decode workers' cores shared as they were bound (``replay.live_core_plan``). The proxy is not
told a cost model, so neither are the simulated policies (eldr-union runs on its
--policy-config cost, as live).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages import paths
from stages.bench.replay.round_scatter import round_scatter, simulated_round_tpot
from stages.bench.replay.saved_run import LiveRun, load_live_runs, replay_workloads
from stages.bench.replay.validation import Compared, Metrics
from stages.bench.replay.worker_cores import CorePlan, live_core_plan
from stages.bench.results import PolicyResult, rate_label
from stages.bench.sim.simulator import SimConfig, simulate_segments
from stages.errors import EldrError
from stages.fit.artifact import Artifact, load_for_serving
from stages.routing.cost_model import CostModel
from stages.routing.policies import needs_centroids
from stages.serve.cluster.launcher import ClusterSpec
from stages.signature.dataset import ModelIdentity, SignatureArrays

# eldr serve's per-worker batch limit (vLLM --max-num-seqs) unless told otherwise.
SERVE_BATCH_SLOTS = ClusterSpec.max_num_seqs


@dataclass(frozen=True)
class Replayed:
    run: LiveRun
    cores: CorePlan
    results: dict[str, PolicyResult]
    compared: Compared
    notes: tuple[str, ...]


def replay_config(
    run: LiveRun, cost: CostModel, cores: CorePlan, seed: int = 0,
    max_batch: int = SERVE_BATCH_SLOTS,
) -> SimConfig:
    last = max(float(s.arrival_s[-1]) for segs in run.segments.values() for s in segs)
    return SimConfig(
        cost=cost,
        num_prefill=run.num_prefill,
        num_decode=run.num_decode,
        request_rate=run.request_rate,
        duration_s=last + 1.0,  # the replayed arrivals' span; no Poisson stream is drawn
        policies=run.policies,
        max_batch=max_batch,
        output_tokens=run.max_tokens,
        max_output_tokens=run.max_tokens,
        max_concurrency=run.max_concurrency,
        decode_cores=cores.decode_groups,
        policy_config=run.policy_config,
        policies_know_cost=False,
        seed=seed,
    )


def _artifact(run: LiveRun, identity: ModelIdentity, store: Path) -> Artifact | None:
    if not any(needs_centroids(p) for p in run.policies):
        return None
    version = run.artifact_version or "latest"
    try:
        return load_for_serving(store, version, identity, run.num_decode)
    except EldrError as exc:
        raise EldrError(
            f"the live run in {run.result_dir} routed with artifact {version}, which {store}"
            f" cannot give ({exc}); pass --store with the artifact store it was fitted in"
        ) from exc


def store_beside(result_dir: Path) -> Path:
    """The artifact store of the ELDR_HOME a results folder lives in (``<home>/results``),
    else the default one: two live runs from two homes replay with their own artifacts."""
    home_store = result_dir.parent / paths.default_artifact_store().name
    return home_store if home_store.is_dir() else paths.default_artifact_store()


def _name(result_dir: Path) -> str:
    """``demo1`` for ``.../demo1/results``: the folder that says which run it was."""
    return result_dir.parent.name if result_dir.name == "results" else result_dir.name


def _header(run: LiveRun, cores: CorePlan, cost: CostModel) -> str:
    per_policy = run.requests_per_policy
    rounds = len(run.segments[run.policies[0]])
    cap = f"at most {run.max_concurrency} in flight" if run.max_concurrency else "no cap"
    return (
        f"replay of {run.result_dir}: {run.shape} live, {rate_label(run.request_rate)} req/s,"
        f" {per_policy} requests per policy in {rounds} rounds, {cap}, {run.max_tokens}"
        f" tokens; {cores.describe()}; cost {cost.name}"
    )


def cost_level(live: Metrics, cost: CostModel) -> dict[str, float]:
    """Per policy, the cost model's step at the live run's mean decode batch and distinct
    experts, over the live mean gap between tokens: how well the measured curve priced the
    steps this run's engine actually took, before any routing or queueing is simulated."""
    out = {}
    for name, m in live.items():
        steps, itl = m.get("decode_steps", 0.0), m.get("mean_itl_ms", math.nan)
        distinct = m.get("distinct_experts_per_layer", math.nan)
        decode_tokens = m.get("total_output_tokens", 0.0) - m.get("completed", 0.0)
        if steps > 0 and decode_tokens > 0 and math.isfinite(itl) and math.isfinite(distinct):
            step = float(cost.step_time(decode_tokens / steps, distinct))
            out[name] = step * 1000.0 / itl
    return out


def engine_pace(level: Mapping[str, float]) -> dict[str, float]:
    """Per policy, how slow the engine ran in its rounds against the median policy's: the
    median cost level over its own (``cost_level``; a lower level is a slower live step)."""
    if not level:
        return {}
    median = float(np.median(list(level.values())))
    return {name: median / value for name, value in level.items() if value > 0}


def _notes(
    run: LiveRun, cores: CorePlan, arrays: SignatureArrays, cost: CostModel
) -> list[str]:
    notes = []
    level = cost_level(run.metrics, cost)
    if level:
        values = sorted(level.values())
        notes.append(
            f"{run.result_dir}: the cost model prices the live steps at {values[0]:.2f}-"
            f"{values[-1]:.2f} of their mean gap between tokens (median"
            f" {float(np.median(values)):.2f}; at each policy's live mean batch and experts):"
            " the engine speed the replay starts from. TPOT moves further than a level error"
            " where requests queue for batch slots (a slower step holds more of them at once)"
        )
    groups = cores.decode_groups
    sharing = max(groups.count(g) for g in groups)
    if cost.core_sharing != sharing:
        notes.append(
            f"{run.result_dir}: the cost model was measured at 1/{cost.core_sharing} of a core"
            f" (core_sharing), the live decode workers ran at 1/{sharing}: the replay's steps"
            f" take {sharing}/{cost.core_sharing} of the model's (an --engine-cost file written"
            " before eldr recorded core_sharing says 1)"
        )
    if cores.prefill_shares_decode_cores():
        notes.append(
            f"{run.result_dir}: prefill workers share cores with decode workers"
            f" ({cores.describe()}); the simulator runs prefill apart at full speed"
        )
    row_of = {str(i): r for r, i in enumerate(arrays.ids.tolist())}
    differ = total = 0
    for segments in run.segments.values():
        for seg in segments:
            rows = np.array([row_of[i] for i in seg.prompt_ids])
            ok = seg.success & (seg.prompt_tokens > 0)
            differ += int((arrays.prompt_tokens[rows][ok] != seg.prompt_tokens[ok]).sum())
            total += int(ok.sum())
    if differ:
        notes.append(
            f"{run.result_dir}: {differ} of {total} requests had another prompt length live"
            " than in the dataset (another tokenizer?); the replay uses the live lengths"
        )
    return notes


def replay_run(
    result_dir: Path,
    arrays: SignatureArrays,
    identity: ModelIdentity,
    cost: CostModel,
    *,
    store: Path,
    seed: int = 0,
    prompts: Path | None = None,
    worker_cores: tuple[str, ...] | None = None,
) -> list[Replayed]:
    """Every request rate of the live run in ``result_dir``, replayed."""
    out = []
    for run in load_live_runs(result_dir, prompts):
        artifact = _artifact(run, identity, store)
        cores = live_core_plan(run.num_prefill, run.num_decode, worker_cores)
        workloads = replay_workloads(run, arrays, artifact)
        config = replay_config(run, cost, cores, seed)
        results = simulate_segments(config, arrays, artifact, workloads, top_k=identity.top_k)
        compared = Compared(
            name=_name(Path(result_dir)),
            header=_header(run, cores, cost),
            live=run.metrics,
            sim={name: r.metrics for name, r in results.items()},
            engine_pace=engine_pace(cost_level(run.metrics, cost)),
            round_scatter=round_scatter(
                {name: [s.tpot_s for s in segs] for name, segs in run.segments.items()},
                {name: simulated_round_tpot(r.table, r.round_sizes) for name, r in results.items()},
            ),
        )
        notes = tuple(_notes(run, cores, arrays, cost))
        out.append(Replayed(run, cores, results, compared, notes))
    return out
