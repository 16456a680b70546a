"""How much of the after-prefill gain a signature known at arrival keeps.

The proxy can pick a decode worker when a request arrives only with a signature made before
its prefill: the cached prefix's counts (from the workers' expert events) plus the token
predictor's estimate for the rest (``stages.signature.token_predictor``). Here each request is
labelled, in ``eldr fit``'s cross-fit, by the same out-of-fold clustering twice: from its
prefill signature (today's rule) and from the predictor's signature of its whole prompt, the
predictor fit on the other folds only (nothing cached: the worst case). The per-step gain of
both labellings is estimated as ``stages.fit.gain`` estimates it, with the same bootstrap
seed, and ``kept`` is their ratio per decode batch size.

A cached prefix lies between the two: its counts are exact, the predictor covers only the
rest. A capture stores whole-prompt counts, never a prefix's, so the exact figure for, say, a
half-cached prompt is not in the data (splitting the prompt's counts would leak the uncached
half's true routing into the estimate); the report gives the two ends and says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stages.fit.cross_fit import CrossFit, Queries
from stages.fit.gain import GainConfig, StepTimeModel, gain_from_labels
from stages.fit.token_fit import TokenFit, fit_token_predictor

ARRIVAL = "arrival"


def arrival_queries(prompts: Sequence[np.ndarray], prefill: np.ndarray) -> Queries:
    """For the cross-fit: the test rows' arrival signatures (whole prompt predicted, nothing
    cached) by a predictor fit on the train rows."""

    def queries(train: np.ndarray, test: np.ndarray) -> dict[str, np.ndarray]:
        predictor = fit_token_predictor([prompts[i] for i in train], prefill[train]).predictor
        return {ARRIVAL: np.stack([predictor.predict_counts(prompts[i]) for i in test])}

    return queries


def arrival_gain(
    crossed: CrossFit,
    profiles: np.ndarray,
    num_layers: int,
    num_clusters: int,
    config: GainConfig,
    seed: int,
    cost: StepTimeModel | None,
    token_fit: TokenFit,
) -> dict[str, Any]:
    """Per batch size, the change in distinct experts per step labelling by the prefill and
    by the arrival signature, and the share of the first the second keeps."""
    def gain_of(labels: np.ndarray) -> dict[str, Any]:
        return gain_from_labels(labels, num_clusters, profiles, num_layers, config,
                                np.random.default_rng(seed), cost)

    prefill, arrival = gain_of(crossed.labels), gain_of(crossed.query_labels[ARRIVAL])
    rows = []
    for after, before in zip(prefill["batches"], arrival["batches"], strict=True):
        row: dict[str, Any] = {"batch_size": after["batch_size"]}
        if "change" in after and "change" in before:
            row.update(prefill_change=after["change"], arrival_change=before["change"])
            # A share of a gain only means something where prefill routing gains.
            if after["change"] < 0:
                row["kept"] = before["change"] / after["change"]
        else:
            row["skipped"] = after.get("skipped") or before.get("skipped")
        rows.append(row)
    predictor = token_fit.predictor
    return {
        "predictor": {
            "tokens": len(predictor.token_ids), "rank": predictor.rank,
            "ridge": token_fit.ridge, "loo_r2": token_fit.loo_r2,
        },
        # Share of requests whose arrival signature lands in their prefill signature's cluster.
        "label_agreement": float(np.mean(crossed.labels == crossed.query_labels[ARRIVAL])),
        "batches": rows,
    }
