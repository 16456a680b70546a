"""A live ``eldr bench`` run read back from its saved results, as the simulator's workload.

Each policy's file (``results.policy_json``) lists every request of every round in plan order
(``loadgen.interleaved_plan``): its send time and client-side queueing (so its scheduled
arrival, ``start - queue``), its prompt and output lengths, and, since results carry them, its
prompt id. Older files without ids are matched to prompts by rebuilding the load generator's
sample (``sample_prompts`` with the run's seed and size). Beside them: the concurrency cap, the
proxy's view of its prefill and decode workers, the artifact, each policy's options and each
round's policy seed (so a replayed random policy draws the live one's choices). How
the workers were bound to cores is not saved; it is ``eldr serve``'s plan on this machine's
cores (``launcher.core_plan``) unless given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from stages import paths
from stages.bench.live.loadgen import Segment, interleaved_plan
from stages.bench.metrics import request_tpot_s
from stages.bench.sim.sim_workload import RoutingArtifact, Workload, workload_of
from stages.errors import EldrError
from stages.prompts import load_prompts, sample_prompts
from stages.routing.policies import POLICIES
from stages.routing.policy_config import PolicyConfig
from stages.signature.dataset import SignatureArrays


@dataclass(frozen=True)
class LiveSegment:
    """One policy's requests of one round, in the order they were scheduled."""

    round: int
    policy_seed: int  # the seed the proxy built the policy with for this round
    arrival_s: np.ndarray  # float64, scheduled arrival from the round's start
    prompt_ids: tuple[str, ...]
    prompt_tokens: np.ndarray  # int64, as the live run counted them (0 for a failure)
    output_tokens: np.ndarray  # int64
    success: np.ndarray  # bool
    tpot_s: np.ndarray  # float64, as live; NaN for a failure, one token, or older results


@dataclass(frozen=True)
class LiveRun:
    """One request rate of a live comparison."""

    result_dir: Path
    request_rate: float
    policies: tuple[str, ...]
    segments: dict[str, tuple[LiveSegment, ...]]
    metrics: dict[str, dict[str, float]]  # the live figures per policy
    max_concurrency: int | None
    max_tokens: int
    num_prefill: int
    num_decode: int
    artifact_version: str | None
    policy_config: PolicyConfig
    prompts_path: Path | None  # None: the results do not say (older files)

    @property
    def shape(self) -> str:
        return f"{self.num_prefill}P{self.num_decode}D"

    @property
    def requests_per_policy(self) -> int:
        return sum(len(s.prompt_ids) for s in self.segments[self.policies[0]])


def _is_live(doc: object) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("start_times"), list)


def _read(path: Path) -> object:
    try:
        return orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise EldrError(f"{path} is not a JSON result file: {exc}") from exc


def results_folder(result_dir: Path) -> Path:
    """``result_dir``, once it is a folder (a live run's results are read from it)."""
    result_dir = Path(result_dir)
    if not result_dir.is_dir():
        raise EldrError(f"no results folder at {result_dir} (--replay takes the results folder"
                        " of a live `eldr bench` run, e.g. .eldr/results)")
    return result_dir


def load_live_runs(result_dir: Path, prompts: Path | None = None) -> list[LiveRun]:
    """Every request rate of the live comparison saved in ``result_dir``.

    ``prompts`` is the prompt file, needed only for results without prompt ids whose run did
    not record its prompt file (default: the bundled evaluation split, `eldr bench`'s).
    """
    result_dir = results_folder(result_dir)
    by_rate: dict[float, list[tuple[Path, dict[str, Any]]]] = {}
    for path in sorted(result_dir.glob("*qps.json")):
        doc = _read(path)
        if _is_live(doc):
            assert isinstance(doc, dict)
            by_rate.setdefault(_rate(doc, path), []).append((path, doc))
    if not by_rate:
        raise EldrError(
            f"{result_dir} holds no live bench results (<policy>-<rate>qps.json files with"
            " per-request lists, written by `eldr bench` against the proxy)"
        )
    return [_live_run(result_dir, rate, files, prompts) for rate, files in sorted(by_rate.items())]


def _rate(doc: dict[str, Any], path: Path) -> float:
    rate = doc.get("request_rate")
    if rate == "inf":
        return math.inf
    if not isinstance(rate, int | float):
        raise EldrError(f"{path} has no request_rate")
    return float(rate)


def _same(files: list[tuple[Path, dict[str, Any]]], key: str) -> Any:
    values = {orjson.dumps(doc.get(key)) for _, doc in files}
    if len(values) > 1:
        raise EldrError(
            f"the result files of one rate disagree on {key!r} ({files[0][0].parent}): were"
            " they written by different runs?"
        )
    return files[0][1].get(key)


def _order(files: list[tuple[Path, dict[str, Any]]]) -> tuple[str, ...]:
    """Policies as the run listed them (its first round's order)."""
    names = [str(doc.get("policy")) for _, doc in files]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise EldrError(f"the results name a policy this eldr does not know: {unknown[0]!r}")
    order = _same(files, "policy_order")
    if isinstance(order, list) and set(order) == set(names):
        return tuple(dict.fromkeys(str(p) for p in order))
    return tuple(names)


def _workers(state: dict[str, Any], key: str) -> int | None:
    workers = state.get(key)
    return len(workers) if isinstance(workers, list) and workers else None


def _live_run(
    result_dir: Path,
    rate: float,
    files: list[tuple[Path, dict[str, Any]]],
    prompts: Path | None,
) -> LiveRun:
    warmup = float(_same(files, "warmup_s") or 0.0)
    if warmup > 0:
        raise EldrError(
            f"the run in {result_dir} was benched with a {warmup:g} s warm-up, whose requests"
            " its results leave out; a replay needs every request (bench with no warm-up)"
        )
    num_prompts = int(_same(files, "num_prompts"))
    seed = int(_same(files, "seed"))
    rounds = int(_same(files, "rounds"))
    max_concurrency = _same(files, "max_concurrency")
    max_tokens = int(_same(files, "max_tokens"))
    policies = _order(files)
    docs = {str(doc["policy"]): doc for _, doc in files}
    plan = _with_seeds(interleaved_plan(num_prompts, policies, rounds), files, result_dir)
    recorded = _same(files, "prompts_path")
    prompts_path = Path(recorded) if isinstance(recorded, str) else prompts
    rebuilt: list[str] | None = None
    segments: dict[str, tuple[LiveSegment, ...]] = {}
    for name in policies:
        doc = docs[name]
        ids = doc.get("prompt_ids")
        if not isinstance(ids, list) or any(not i for i in ids):
            if rebuilt is None:
                source = prompts or prompts_path or paths.EVALUATION_PROMPTS
                sample = sample_prompts(load_prompts(source), num_prompts, seed)
                rebuilt = [p.id for p in sample]
                prompts_path = source
            ids = [rebuilt[i] for s in plan if s.policy == name for i in range(s.start, s.stop)]
        segments[name] = _segments(doc, [s for s in plan if s.policy == name], ids, max_tokens)
    state = _first_state(_same(files, "proxy_state"), policies)
    num_decode = _workers(state, "decode_workers") or len(_same(files, "decode_urls") or [])
    num_prefill = _workers(state, "prefill_workers")
    if not num_decode or not num_prefill:
        raise EldrError(
            f"the results in {result_dir} do not say how many prefill and decode workers"
            " served the run (no proxy_state)"
        )
    metrics = {
        name: {k: float(v) for k, v in docs[name].items() if _is_number(v)} for name in policies
    }
    version = state.get("artifact_version")
    return LiveRun(
        result_dir=result_dir,
        request_rate=rate,
        policies=policies,
        segments=segments,
        metrics=metrics,
        max_concurrency=int(max_concurrency) if max_concurrency else None,
        max_tokens=max_tokens,
        num_prefill=num_prefill,
        num_decode=num_decode,
        artifact_version=version if isinstance(version, str) else None,
        policy_config=_policy_config(_same(files, "proxy_state"), policies),
        prompts_path=prompts_path,
    )


def _with_seeds(
    plan: list[Segment], files: list[tuple[Path, dict[str, Any]]], result_dir: Path
) -> list[Segment]:
    """The plan with each round's recorded policy seed; results from before the bench seeded
    rounds ran every round on the proxy's own seed (``eldr serve --seed``, 0 by default)."""
    seeds = _same(files, "policy_seeds")
    if seeds is None:
        return [replace(s, policy_seed=0) for s in plan]
    if (
        not isinstance(seeds, list)
        or len(seeds) != len(plan)
        or not all(type(x) is int for x in seeds)
    ):
        raise EldrError(f"the results in {result_dir} list policy seeds that do not match"
                        f" their {len(plan)} policy rounds")
    return [replace(s, policy_seed=x) for s, x in zip(plan, seeds, strict=True)]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _first_state(states: object, policies: Sequence[str]) -> dict[str, Any]:
    if isinstance(states, dict):
        for name in policies:
            state = states.get(name)
            if isinstance(state, dict):
                return state
    return {}


def _policy_config(states: object, policies: Sequence[str]) -> PolicyConfig:
    """Each policy's options as the proxy reported them when switched to it (older results
    did not report them: the policies' defaults)."""
    doc = {}
    if isinstance(states, dict):
        for name in policies:
            state = states.get(name)
            config = state.get("config") if isinstance(state, dict) else None
            if isinstance(config, dict) and config:
                doc[name] = config
    return PolicyConfig.from_mapping(doc)


def _segments(
    doc: dict[str, Any], plan: Sequence[Any], ids: Sequence[str], max_tokens: int
) -> tuple[LiveSegment, ...]:
    columns = {
        key: doc.get(key)
        for key in ("start_times", "queue_times", "input_lens", "output_lens", "errors")
    }
    timing = {key: doc.get(key) for key in ("latencies", "ttfts")}
    timed = all(isinstance(v, list) and len(v) == len(ids) for v in timing.values())
    total = sum(s.stop - s.start for s in plan)
    bad = [k for k, v in columns.items() if not isinstance(v, list) or len(v) != total]
    if bad or len(ids) != total:
        raise EldrError(
            f"policy {doc.get('policy')!r}: the results hold per-request lists of another"
            f" length than the {total} requests of its rounds ({', '.join(bad) or 'prompt_ids'})"
        )
    out = []
    at = 0
    for seg in plan:
        part = slice(at, at + seg.stop - seg.start)
        at = part.stop
        start = np.asarray(columns["start_times"][part], dtype=np.float64)
        queue = np.asarray(columns["queue_times"][part], dtype=np.float64)
        success = np.array([not e for e in columns["errors"][part]], dtype=bool)
        output = np.asarray(columns["output_lens"][part], dtype=np.int64)
        tpot = request_tpot_s(
            success, output, np.asarray(timing["ttfts"][part], dtype=np.float64),
            np.asarray(timing["latencies"][part], dtype=np.float64),
        ) if timed else np.full(output.size, np.nan)
        out.append(
            LiveSegment(
                round=seg.round,
                policy_seed=seg.policy_seed,
                # Sorted as scheduled; the subtraction's rounding must not reorder them.
                arrival_s=np.maximum.accumulate(np.maximum(start - queue, 0.0)),
                prompt_ids=tuple(str(i) for i in ids[part]),
                prompt_tokens=np.asarray(columns["input_lens"][part], dtype=np.int64),
                output_tokens=np.where(success, output, max_tokens),
                success=success,
                tpot_s=tpot,
            )
        )
    return tuple(out)


def replay_workloads(
    run: LiveRun, arrays: SignatureArrays, artifact: RoutingArtifact | None
) -> dict[str, list[Workload]]:
    """Each policy's rounds as simulator workloads on the dataset's rows for their prompts."""
    row_of = {str(i): r for r, i in enumerate(arrays.ids.tolist())}
    wanted = {i for segs in run.segments.values() for s in segs for i in s.prompt_ids}
    missing = sorted(wanted - row_of.keys())
    if missing:
        source = run.prompts_path or "the prompts the run sent"
        raise EldrError(
            f"the signature dataset lacks {len(missing)} of the live run's {len(wanted)}"
            f" prompts (e.g. {missing[0]!r}); capture them first: eldr capture --prompts"
            f" {source} --max-tokens {run.max_tokens} --out <dataset>"
        )
    out: dict[str, list[Workload]] = {}
    for name, segments in run.segments.items():
        out[name] = []
        for seg in segments:
            rows = np.array([row_of[i] for i in seg.prompt_ids], dtype=np.int64)
            live = seg.prompt_tokens
            prompt = np.where(live > 0, live, arrays.prompt_tokens[rows])
            workload = workload_of(arrays, seg.arrival_s, rows, prompt, seg.output_tokens,
                                   artifact)
            out[name].append(replace(workload, policy_seed=seg.policy_seed))
    return out
