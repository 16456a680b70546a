"""The comparison table: one row per policy, TPOT ratios against the best baseline.

"Best baseline" follows the paper: for each statistic separately, the best of the four load
balancers (rr, jsq, random, p2c) that took part; a ratio below 1 means the policy beat all of
them on that statistic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from stages.bench.metric_registry import COLUMNS, OVER_BEST
from stages.routing.policies import POLICIES

# The load balancers: the registered policies that read neither features nor counts nor KV.
BASELINES = tuple(
    name for name, cls in POLICIES.items()
    if not (cls.uses_signature or cls.uses_counts or cls.reads_kv)
)
Metrics = Mapping[str, Mapping[str, float]]


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.2f}"


def best_baseline(
    metrics: Metrics, key: str, baselines: Sequence[str] = BASELINES
) -> tuple[str, float] | None:
    """(policy, value) of the lowest finite ``key`` among the baselines present."""
    found = [
        (name, float(m[key]))
        for name, m in metrics.items()
        if name in baselines and key in m and math.isfinite(float(m[key]))
    ]
    return min(found, key=lambda item: item[1]) if found else None


def ratios_to_best(
    metrics: Metrics, baselines: Sequence[str] = BASELINES
) -> dict[str, dict[str, float]]:
    """policy -> {key: value / best baseline value} for the TPOT keys (NaN without one)."""
    out: dict[str, dict[str, float]] = {name: {} for name in metrics}
    for key in (m.key for m in OVER_BEST):
        best = best_baseline(metrics, key, baselines)
        for name, m in metrics.items():
            value = float(m.get(key, float("nan")))
            ok = best is not None and best[1] > 0 and math.isfinite(value)
            out[name][key] = value / best[1] if ok else float("nan")
    return out


def format_comparison(
    metrics: Metrics, title: str = "", baselines: Sequence[str] = BASELINES
) -> str:
    """A fixed-width table (milliseconds for latencies) plus the best-baseline footnote."""
    ratios = ratios_to_best(metrics, baselines)
    header = ["policy", *(m.label for m in COLUMNS)]
    header += [f"{m.label} /best" for m in OVER_BEST]
    rows = [header]
    for name, m in metrics.items():
        row = [name, *(_fmt(m.get(c.key)) for c in COLUMNS)]
        row += [_fmt(ratios[name][c.key]) for c in OVER_BEST]
        rows.append(row)
    lines = ([title] if title else []) + _table(rows)
    notes = []
    for metric in OVER_BEST:
        best = best_baseline(metrics, metric.key, baselines)
        if best is not None:
            notes.append(f"{metric.label} {best[0]} {_fmt(best[1])} {metric.unit}")
    lines.append(
        "best baseline: " + ", ".join(notes) if notes else "no baseline policy in this run"
    )
    lines.append("latencies in ms; experts/L = distinct experts per MoE layer per decode step")
    return "\n".join(lines)


def format_conversations(metrics: Mapping[str, Mapping[str, object]], title: str = "") -> str:
    """The conversation bench's table: TTFT of first and later turns, TPOT, prefix-hit shares
    against the workload's ideal, KV tokens the decode workers pulled; then each router's
    hit share per prefill worker."""
    from stages.bench.metric_registry import CONVERSATION_METRICS, SIM_TTFT_PARTS, TTFT_PARTS

    header = ["router", *(m.label for m in CONVERSATION_METRICS)]
    rows = [header]
    for name, m in metrics.items():
        rows.append([name, *(_fmt(_number(m.get(c.key))) for c in CONVERSATION_METRICS)])
    lines = ([title] if title else []) + _table(rows)
    for name, m in metrics.items():
        per_worker = m.get("prefill_hit_share_by_worker")
        if isinstance(per_worker, list) and per_worker:
            line = f"{name}: prefill hit share per worker " + " / ".join(
                _fmt(_number(v)) for v in per_worker)
            requests, engine = m.get("prefill_requests_by_worker"), m.get(
                "prefill_engine_ms_by_worker")
            if isinstance(requests, list) and isinstance(engine, list) and any(
                    math.isfinite(_number(v) or math.nan) for v in engine):
                line += ("; requests " + " / ".join(f"{_number(v) or 0:.0f}" for v in requests)
                         + "; engine ms " + " / ".join(_fmt(_number(v)) for v in engine))
            lines.append(line)
        requests, ttft = m.get("decode_requests_by_worker"), m.get(
            "decode_engine_ttft_ms_by_worker")
        if isinstance(requests, list) and isinstance(ttft, list) and any(
                math.isfinite(_number(v) or math.nan) for v in ttft):
            lines.append(f"{name}: decode requests per worker "
                         + " / ".join(f"{_number(v) or 0:.0f}" for v in requests)
                         + "; engine TTFT ms " + " / ".join(_fmt(_number(v)) for v in ttft))
    lines.append("latencies in ms; t1 = first turns, t>=2 = later turns; P hit = prefill"
                 " workers' vllm:prefix_cache_hits / queries; P ideal = every turn on the"
                 " worker holding its history; D pulled = prompt tokens the decode workers"
                 " pulled over the KV connector")
    parts = [[name, *(_fmt(_number(m.get(c.key))) for c in TTFT_PARTS)]
             for name, m in metrics.items()
             if math.isfinite(_number(m.get("decode_engine_ttft_ms")) or math.nan)]
    if parts:
        lines += ["", "where TTFT goes (means over all turns, ms; the workers' own histograms)"]
        lines += _table([["router", *(c.label for c in TTFT_PARTS)], *parts])
    sim_parts = [[name, *(_fmt(_number(m.get(c.key))) for c in SIM_TTFT_PARTS)]
                 for name, m in metrics.items()
                 if math.isfinite(_number(m.get("sim_ttft_later_pd_ms")) or math.nan)]
    if sim_parts:
        lines += ["", "where later turns' TTFT goes (simulated, PD path, means, ms)"]
        lines += _table([["router", *(c.label for c in SIM_TTFT_PARTS)], *sim_parts])
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """``rows`` (the header first) as fixed-width lines: names left, figures right, a rule
    under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None
