"""The per-step gain estimate (``stages.fit.gain``) in words: a table and a plain verdict
that names the batch sizes it rests on and those it could not estimate.

Read from the dict the artifact stores, so ``eldr fit`` and ``eldr artifacts show`` say the
same thing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stages.fit.gain import MEMBERS_PER_SLOT, MIN_TPOT_GAIN

# Named in the advice; tests check they are registered decode policies. eldr-union first: it
# matches the centroid rules' median where locality is strong and keeps the tail (README,
# "Which policy"); eldr-bl packs harder, which pays on two or three decode workers.
BALANCERS = ("jsq", "rr")
LOCALITY_POLICIES = ("eldr-union", "eldr-bl")
# Below this share of out-of-fold labels that are the artifact's nearest centroid, the folds
# split the requests otherwise than the artifact did, and pooling their labels mixes clusters.
STABLE_AGREEMENT = 0.8


def gain_lines(gain: dict[str, Any], k: int) -> list[str]:
    """Header, one row per batch size, the verdict line."""
    cost = gain.get("cost_model")
    lines = [_header(gain, k)]
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
    lines += _stability_note(gain, k)
    lines.append(verdict_line(gain))
    if "arrival" in gain:  # fits since the token predictor (``stages.fit.arrival_gain``)
        lines += arrival_lines(gain["arrival"])
    return lines


def arrival_lines(arrival: dict[str, Any]) -> list[str]:
    """The gain kept by a signature made at arrival: a row per batch size, with nothing cached
    and, where the capture holds prompts that extend others, with their cached prefix."""
    if "skipped" in arrival:
        return [f"signature at arrival: not measured: {arrival['skipped']}"]
    predictor = arrival["predictor"]
    with_prefix = "label_agreement_cached" in arrival
    lines = [
        "signature at arrival (token predictor: per-token mean routing over"
        f" {predictor['tokens']} tokens, leave-one-out R^2 {predictor['loo_r2']:.2f};"
        " cross-fitted, the predictor fit without the request), change in distinct"
        " experts/layer/step:",
        f"  {'batch':>5}  {'after prefill':>13}  {'arrival, nothing cached':>23}  {'kept':>5}"
        + (f"  {'arrival, cached prefix':>22}  {'kept':>5}" if with_prefix else ""),
    ]
    for row in arrival["batches"]:
        if "skipped" in row:
            lines.append(f"  {row['batch_size']:>5}  not estimated: {row['skipped']}")
            continue
        line = (f"  {row['batch_size']:>5}  {row['prefill_change']:>+13.1%}"
                f"  {row['arrival_change']:>+23.1%}  {_share(row.get('kept')):>5}")
        if with_prefix and "arrival_cached_change" in row:
            line += (f"  {row['arrival_cached_change']:>+22.1%}"
                     f"  {_share(row.get('kept_cached')):>5}")
        lines.append(line)
    agreement = (f"  {arrival['label_agreement']:.0%} of requests land in their prefill"
                 " signature's cluster with nothing cached")
    if with_prefix:
        lines.append(agreement + f", {arrival['label_agreement_cached']:.0%} with a cached"
                     " prefix (a request extending another captured prompt, as a"
                     " conversation's next turn: that prompt's exact counts, the rest"
                     " predicted)")
    else:
        lines.append(agreement + "; with a cached prefix: not measured (no captured prompt"
                     " extends another, as a conversation's next turn would)")
    return lines


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _stability_note(gain: dict[str, Any], k: int) -> list[str]:
    """Why a cross-fit may read less locality than the artifact's own clusters hold."""
    agreement = gain.get("label_agreement")
    if agreement is None or agreement >= STABLE_AGREEMENT:
        return []
    # Same-cluster batches of two mixed clusters touch more experts than either cluster's own
    # (the miss probability is convex in the mix): the mismatch only shrinks the gain.
    return [
        f"  note: only {agreement:.0%} of the out-of-fold labels are the artifact's nearest"
        f" centroid: the folds split the requests otherwise (k={k} clusters that are not"
        " stable), so pooled batches mix clusters and the gain above likely understates what"
        " the artifact's own clusters buy"
    ]


def _header(gain: dict[str, Any], k: int) -> str:
    # Artifacts fit before the cross-fit carry no "method": their estimate is the held-out
    # split's, labelled by the artifact's own centroids.
    if gain.get("method") == "cross-fit":
        requests = (
            f"all {gain['num_holdout']} requests' decode profiles, each labelled by centroids"
            f" fit without it ({gain['folds']}-fold cross-fit, clusters matched to the"
            f" artifact's; {gain['label_agreement']:.0%} of the labels are the artifact's"
            " nearest centroid)"
        )
    else:
        requests = f"{gain['num_holdout']} held-out requests' decode profiles"
    return (
        f"expected per-step gain of routing by centroid (k={k}), on {requests}, each arm the"
        f" exact mean over every possible batch; {round(100 * gain['confidence'])}% intervals"
        f" from a bootstrap over the requests ({gain['num_resamples']} resamples)"
    )


def verdict_line(gain: dict[str, Any]) -> str:
    """The verdict, the batch sizes it rests on, and those it could not estimate."""
    verdict = gain["verdict"]
    balancer = f"Use a load balancer: `--policy {BALANCERS[0]}` (or `{BALANCERS[1]}`)."
    rows = [r for r in gain["batches"] if "verdict" in r]
    skipped = _not_estimated(gain["batches"])
    caveat = f"; {skipped}" if skipped else ""
    if verdict == "gain":
        return (
            f"verdict: expected gain at {_rests_on(rows, 'gain', gain)}"
            f"{_others(rows, 'gain')}{caveat}. Route with `--policy {LOCALITY_POLICIES[0]}`"
            f" (or `{LOCALITY_POLICIES[1]}` on two or three decode workers)."
        )
    if verdict == "negligible":
        return (
            f"verdict: gain too small to matter at {_rests_on(rows, 'negligible', gain)}: fewer"
            f" distinct experts, but under {MIN_TPOT_GAIN:.0%} TPOT, less than centroid routing"
            f" can cost in tail latency{_others(rows, 'negligible')}{caveat}. {balancer}"
        )
    if verdict == "none":
        return (
            f"verdict: no expected gain at {_batches(rows)}: every interval includes zero, so"
            " on this data the prefill signature does not predict which experts decode uses"
            f"{caveat}. {balancer}"
        )
    if verdict in ("worse", "mixed"):
        return (
            "verdict: no expected gain: same-cluster batches use more distinct experts at"
            f" {_rests_on(rows, 'worse', gain)}{_others(rows, 'worse')}{caveat}. {balancer}"
        )
    return (
        f"verdict: cannot tell: {skipped}. A batch of B needs clusters of {MEMBERS_PER_SLOT}B"
        " requests: capture more signatures or lower --k."
    )


def _batches(rows: list[dict[str, Any]]) -> str:
    """``batch 8``, ``batch 8 and 16``, ``batch 4, 8 and 16``."""
    sizes = [str(r["batch_size"]) for r in rows]
    listed = sizes[0] if len(sizes) == 1 else f"{', '.join(sizes[:-1])} and {sizes[-1]}"
    return f"batch {listed}"


def _rests_on(rows: list[dict[str, Any]], word: str, gain: dict[str, Any]) -> str:
    """The batch sizes with verdict ``word`` and what each changes: TPOT where a cost model
    predicted it, else distinct experts per step."""
    picked = [r for r in rows if r["verdict"] == word]
    changes = f"{_percents(r['change'] for r in picked)} distinct experts per step"
    if all("tpot_change" in r for r in picked):
        tpot = _percents(r["tpot_change"] for r in picked)
        changes = f"{tpot} TPOT with the {gain['cost_model']} cost model; {changes}"
    return f"{_batches(picked)} ({changes})"


def _percents(values: Iterable[float]) -> str:
    return ", ".join(f"{v:+.1%}" for v in values)


def _others(rows: list[dict[str, Any]], word: str) -> str:
    """``; within noise at batch 4; worse at batch 32``: the estimated sizes that say
    otherwise, by what they say."""
    parts = []
    for other in ("gain", "negligible", "none", "worse"):
        same = [r for r in rows if r["verdict"] == other]
        if other != word and same:
            parts.append(f"; {_WORDS[other]} at {_batches(same)}")
    return "".join(parts)


def _not_estimated(batches: list[dict[str, Any]]) -> str:
    """``not estimated at 16: <why>; at 32: <why>`` over the batch sizes the estimate skipped,
    empty when it skipped none."""
    skipped = [r for r in batches if "skipped" in r]
    if not skipped:
        return ""
    reasons = "; at ".join(f"{r['batch_size']}: {r['skipped']}" for r in skipped)
    return f"not estimated at {reasons}"


def _change(point: float, ci: list[float]) -> str:
    return f"{point:+.1%} [{ci[0]:+.1%}, {ci[1]:+.1%}]"


_WORDS = {
    "gain": "gain",
    "negligible": f"gain under {MIN_TPOT_GAIN:.0%} TPOT",
    "none": "within noise",
    "worse": "worse",
}
