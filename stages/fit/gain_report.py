"""The held-out gain estimate (``stages.fit.gain``) in words: a table and a plain verdict.

Read from the dict the artifact stores, so ``eldr fit`` and ``eldr artifacts show`` say the
same thing.
"""

from __future__ import annotations

from typing import Any

from stages.fit.gain import MEMBERS_PER_SLOT, MIN_TPOT_GAIN

# Named in the advice; tests check they are registered decode policies. eldr-union first: it
# matches the centroid rules' median where locality is strong and keeps the tail (README,
# "Which policy"); eldr-bl packs harder, which pays on two or three decode workers.
BALANCERS = ("jsq", "rr")
LOCALITY_POLICIES = ("eldr-union", "eldr-bl")


def gain_lines(gain: dict[str, Any], k: int) -> list[str]:
    """Header, one row per batch size, the verdict line."""
    cost = gain.get("cost_model")
    level = round(100 * gain["confidence"])
    lines = [
        f"expected per-step gain of routing by centroid (k={k}), on {gain['num_holdout']}"
        f" held-out requests' decode profiles, each arm the exact mean over every possible"
        f" batch; {level}% intervals from a bootstrap over the requests"
        f" ({gain['num_resamples']} resamples)",
    ]
    if any("change" in row for row in gain["batches"]):
        lines.append(
            f"  {'batch':>5}  {'batches':>8}  {'same-cluster':>12}  {'random':>7}"
            f"  {'distinct experts/layer/step':<30}"
            + (f"  {'TPOT (' + cost + ' cost)':<28}" if cost else "")
            + "  verdict"
        )
    for row in gain["batches"]:
        if "skipped" in row:
            lines.append(f"  {row['batch_size']:>5}  not estimated: {row['skipped']}")
            continue
        batches = min(row["same_cluster_batches"], row["random_batches"])
        line = (
            f"  {row['batch_size']:>5}  {batches:>8.2g}"
            f"  {row['same_cluster_distinct_experts_per_layer']:>12.2f}"
            f"  {row['random_distinct_experts_per_layer']:>7.2f}"
            f"  {_change(row['change'], row['change_ci']):<30}"
        )
        if cost:
            line += f"  {_change(row['tpot_change'], row['tpot_change_ci']):<28}"
        lines.append(line + f"  {_WORDS[row['verdict']]}")
    lines.append(verdict_line(gain))
    return lines


def verdict_line(gain: dict[str, Any]) -> str:
    verdict = gain["verdict"]
    balancer = f"`--policy {BALANCERS[0]}` (or `{BALANCERS[1]}`)"
    rows = [r for r in gain["batches"] if "verdict" in r]
    if verdict == "gain":
        best = min((r for r in rows if r["verdict"] == "gain"), key=_tpot_or_change)
        tpot = (
            f", TPOT {best['tpot_change']:+.1%} with the {gain['cost_model']} cost model"
            if "tpot_change" in best else ""
        )
        others = [f"{_WORDS[r['verdict']]} at batch {r['batch_size']}"
                  for r in rows if r["verdict"] != "gain"]
        caveat = f" ({'; '.join(others)})" if others else ""
        if any("skipped" in r for r in gain["batches"]):
            caveat += "; larger batches need more held-out requests per cluster"
        return (
            f"verdict: expected gain: same-cluster decode batches of {best['batch_size']} use"
            f" {-best['change']:.1%} fewer distinct experts per step{tpot}{caveat}. Route with"
            f" `--policy {LOCALITY_POLICIES[0]}` (or `{LOCALITY_POLICIES[1]}` on two or three"
            " decode workers)."
        )
    if verdict == "negligible":
        return (
            f"verdict: gain too small to matter: fewer distinct experts, but under"
            f" {MIN_TPOT_GAIN:.0%} TPOT, less than centroid routing can cost in tail latency."
            f" Use a load balancer: {balancer}."
        )
    if verdict == "none":
        return (
            "verdict: no expected gain: every interval includes zero, so on this data the"
            " prefill signature does not predict which experts decode uses. Use a load"
            f" balancer: {balancer}."
        )
    if verdict in ("worse", "mixed"):
        return (
            "verdict: no expected gain: same-cluster batches use more distinct experts at some"
            f" batch sizes. Use a load balancer: {balancer}."
        )
    return (
        "verdict: cannot tell: too few held-out requests per cluster for any batch size (a"
        f" batch of B needs clusters of {MEMBERS_PER_SLOT}B). Capture more signatures or"
        " lower --k."
    )


def _tpot_or_change(row: dict[str, Any]) -> float:
    return float(row.get("tpot_change", row["change"]))


def _change(point: float, ci: list[float]) -> str:
    return f"{point:+.1%} [{ci[0]:+.1%}, {ci[1]:+.1%}]"


_WORDS = {
    "gain": "gain",
    "negligible": f"gain under {MIN_TPOT_GAIN:.0%} TPOT",
    "none": "within noise",
    "worse": "worse",
}
