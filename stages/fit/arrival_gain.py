"""How much of the after-prefill gain a signature known at arrival keeps.

The proxy can pick a decode worker when a request arrives only with a signature made before
its prefill: the cached prefix's counts (from the workers' expert events) plus the token
predictor's estimate for the rest (``stages.signature.token_predictor``). Here each request is
labelled, in ``eldr fit``'s cross-fit, by the same out-of-fold clustering twice: from its
prefill signature (today's rule) and from the predictor's signature of its whole prompt, the
predictor fit on the other folds only (nothing cached: the worst case). The per-step gain of
both labellings is estimated as ``stages.fit.gain`` estimates it, with the same bootstrap
seed, and ``kept`` is their ratio per decode batch size.

With a cached prefix: a capture stores whole-prompt counts, never a prefix's (splitting a
prompt's counts would leak the uncached part's true routing into the estimate), but where a
captured prompt extends another one (a conversation's next turn holds the last one), the
other's counts are exactly its prefix's, as the workers' expert events would give them at
arrival. So a third labelling (``ARRIVAL_CACHED``) takes, for each request extending another
captured prompt, the longest such prompt's counts plus the predictor's estimate of the rest;
the other requests keep their nothing-cached signature. Without any such pair in the capture
it is not measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stages.fit.cross_fit import CrossFit, Queries
from stages.fit.gain import GainConfig, StepTimeModel, gain_from_labels
from stages.fit.token_fit import TokenFit, fit_token_predictor

ARRIVAL = "arrival"
ARRIVAL_CACHED = "arrival_cached"


def longest_prefixes(prompts: Sequence[np.ndarray]) -> np.ndarray:
    """``[N]``: for each prompt, the longest other prompt that is a strict prefix of it (by
    index), -1 where none is."""
    ids = [np.ascontiguousarray(p, dtype=np.int64) for p in prompts]
    by_bytes = {p.tobytes(): i for i, p in enumerate(ids)}
    # Only prompts that share a first token can be prefixes: their lengths, longest first.
    lengths: dict[int, set[int]] = {}
    for p in ids:
        if len(p):
            lengths.setdefault(int(p[0]), set()).add(len(p))
    out = np.full(len(ids), -1, np.int64)
    for i, p in enumerate(ids):
        for n in sorted(lengths.get(int(p[0]), ()) if len(p) else (), reverse=True):
            if n < len(p) and (j := by_bytes.get(p[:n].tobytes())) is not None:
                out[i] = j
                break
    return out


def arrival_queries(prompts: Sequence[np.ndarray], prefill: np.ndarray) -> Queries:
    """For the cross-fit: the test rows' arrival signatures by a predictor fit on the train
    rows: the whole prompt predicted (nothing cached) and, where the capture holds a prefix of
    the prompt, that prefix's exact counts plus the rest predicted."""
    prefix = longest_prefixes(prompts)

    def queries(train: np.ndarray, test: np.ndarray) -> dict[str, np.ndarray]:
        predictor = fit_token_predictor([prompts[i] for i in train], prefill[train]).predictor
        cold = np.stack([predictor.predict_counts(prompts[i]) for i in test])
        out = {ARRIVAL: cold}
        if (prefix >= 0).any():
            cached = cold.copy()
            for row, i in enumerate(test):
                if (j := prefix[i]) >= 0:
                    cached[row] = prefill[j] + predictor.predict_counts(
                        prompts[i][len(prompts[j]):])
            out[ARRIVAL_CACHED] = cached
        return out

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
    labels_cached = crossed.query_labels.get(ARRIVAL_CACHED)
    cached = None if labels_cached is None else gain_of(labels_cached)
    rows = []
    for b, (after, before) in enumerate(zip(prefill["batches"], arrival["batches"],
                                            strict=True)):
        row: dict[str, Any] = {"batch_size": after["batch_size"]}
        if "change" in after and "change" in before:
            row.update(prefill_change=after["change"], arrival_change=before["change"])
            # A share of a gain only means something where prefill routing gains.
            if after["change"] < 0:
                row["kept"] = before["change"] / after["change"]
            with_prefix = None if cached is None else cached["batches"][b]
            if with_prefix is not None and "change" in with_prefix:
                row["arrival_cached_change"] = with_prefix["change"]
                if after["change"] < 0:
                    row["kept_cached"] = with_prefix["change"] / after["change"]
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
        **({} if labels_cached is None else {
            "label_agreement_cached": float(np.mean(crossed.labels == labels_cached))}),
        "batches": rows,
    }
