"""A conversation bench's runs -> one metrics dict per router (``vllm bench serve``'s keys,
plus ``CONVERSATION_METRICS``), and its results files."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import orjson

from stages.bench.live import engine_latency
from stages.bench.live.cache_counters import total
from stages.bench.live.conversation_run import RunOutcome
from stages.bench.live.engine_latency import ttft_parts_ms
from stages.bench.live.worker_metrics import total_expert_stats
from stages.bench.metrics import RequestTable, summarize
from stages.bench.results import PolicyResult, policy_json
from stages.bench.turn_metrics import round_spread_ms, share, ttft_by_turn
from stages.bench.workloads.ideal_hits import ideal_hits


def target_metrics(runs: Sequence[RunOutcome], block_size: int) -> dict[str, object]:
    """One router's figures over its runs (rounds)."""
    turns = [t for run in runs for t in run.turns]
    records = [t.record for t in turns]
    table = RequestTable.from_records(records)
    metrics: dict[str, object] = dict(summarize(table, sum(r.duration_s for r in runs)))
    metrics |= ttft_by_turn(table.ttft_s, np.array([t.turn for t in turns]), table.success)
    metrics["ttft_later_round_spread_ms"] = round_spread_ms([
        np.array([t.record.ttft_s for t in run.turns if t.turn >= 2 and t.record.success])
        for run in runs])
    # TPOT is compared against its own rounds' noise as TTFT is (the same max - min of p50s).
    metrics["tpot_round_spread_ms"] = round_spread_ms([
        RequestTable.from_records([t.record for t in run.turns]).tpot_s() for run in runs])
    prefill = total(c for run in runs for c in run.prefill.values())
    decode = total(c for run in runs for c in run.decode.values())
    workers = sorted({url for run in runs for url in run.prefill})
    metrics["prefill_hit_share"] = prefill.hit_share
    metrics["prefill_hit_share_by_worker"] = [
        total(run.prefill[u] for run in runs if u in run.prefill).hit_share for u in workers]
    metrics["prefill_workers"] = workers
    metrics["decode_kv_pulled_tokens"] = decode.external_tokens
    metrics["decode_hit_share"] = decode.hit_share
    ideal = [ideal_hits([t.sent for t in run.turns], block_size) for run in runs]
    prompt = sum(i.prompt_tokens for i in ideal)
    metrics["ideal_prefill_hit_share"] = share(sum(i.prefill_hit_tokens for i in ideal), prompt)
    metrics["ideal_history_hit_share"] = share(sum(i.history_hit_tokens for i in ideal), prompt)
    # Prompt tokens that reached no prefill worker (a decode worker prefilled them itself).
    metrics["local_prefill_share"] = (
        max(0.0, 1.0 - prefill.queries / prompt)
        if prompt > 0 and not math.isnan(prefill.queries) else math.nan)
    ideal_share = float(metrics["ideal_prefill_hit_share"])  # type: ignore[arg-type]
    metrics["prefill_hit_of_ideal"] = (prefill.hit_share / ideal_share
                                       if ideal_share > 0 else math.nan)
    metrics["history_pairs_dropped"] = sum(r.dropped_pairs for r in runs)
    # Each prefill worker's own share of the requests and mean time per request: whether a
    # router's prefill time is its placement (workers sharing cores) or the work itself.
    by_worker = [engine_latency.total(run.prefill_latency[u] for run in runs
                                      if u in run.prefill_latency) for u in workers]
    metrics["prefill_requests_by_worker"] = [e.e2e_n for e in by_worker]
    metrics["prefill_engine_ms_by_worker"] = [e.mean_ms("e2e") for e in by_worker]
    # The same for decode: whether a router concentrates decode on one worker or spreads it
    # (workers sharing a core time-slice it), and each one's time to first token.
    decoders = sorted({url for run in runs for url in run.decode_latency})
    by_decoder = [engine_latency.total(run.decode_latency[u] for run in runs
                                       if u in run.decode_latency) for u in decoders]
    metrics["decode_workers"] = decoders
    metrics["decode_requests_by_worker"] = [e.ttft_n for e in by_decoder]
    metrics["decode_engine_ttft_ms_by_worker"] = [e.mean_ms("ttft") for e in by_decoder]
    ttft = table.ttft_s[table.success]
    metrics |= ttft_parts_ms(
        1e3 * float(ttft.mean()) if ttft.size else math.nan,
        engine_latency.total(e for run in runs for e in run.prefill_latency.values()),
        engine_latency.total(e for run in runs for e in run.decode_latency.values()))
    rounds = [r.experts for r in runs]
    experts = total_expert_stats(rounds)
    if experts is not None:
        metrics |= experts.as_dict()
        # Each round's own figure, so a difference in experts is read against its noise as
        # TTFT's and TPOT's are (one run per round).
        per_round = [e.active_experts_per_step for e in rounds]  # type: ignore[union-attr]
        metrics["active_experts_per_step_by_round"] = per_round
        metrics["active_experts_round_spread"] = (max(per_round) - min(per_round)
                                                  if len(per_round) > 1 else math.nan)
    return metrics


def conversation_metrics(outcomes: Sequence[RunOutcome], names: Sequence[str],
                         block_size: int) -> dict[str, dict[str, object]]:
    return {name: target_metrics([o for o in outcomes if o.target == name], block_size)
            for name in names}


def save_conversation_results(outcomes: Sequence[RunOutcome],
                              metrics: dict[str, dict[str, object]], info: dict[str, object],
                              result_dir: Path) -> list[Path]:
    """``<router>-conversations.json`` each: vLLM's keys and per-request lists, plus each
    request's conversation and turn."""
    result_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, m in metrics.items():
        turns = [t for o in outcomes if o.target == name for t in o.turns]
        records = tuple(t.record for t in turns)
        result = PolicyResult(name, m, RequestTable.from_records(records),  # type: ignore[arg-type]
                              records)
        doc = policy_json(result, math.inf, info)
        doc["turns"] = [t.turn for t in turns]
        doc["conversations"] = [t.conversation for t in turns]
        doc["turn_rounds"] = [o.round for o in outcomes if o.target == name for _ in o.turns]
        path = result_dir / f"{name}-conversations.json"
        path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        paths.append(path)
    return paths
