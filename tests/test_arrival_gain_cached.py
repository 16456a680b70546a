"""The gain kept at arrival with a cached prefix: prompts of the capture that extend others (a
conversation's turns) give their prefix's exact counts; the rest is predicted."""

import numpy as np

from stages.fit.arrival_gain import ARRIVAL, ARRIVAL_CACHED, arrival_queries, longest_prefixes
from stages.fit.gain_report import arrival_lines


def test_each_prompt_finds_the_longest_other_prompt_it_extends() -> None:
    prompts = [np.array([1, 2]), np.array([1, 2, 3, 4]), np.array([1, 2, 3, 4, 5]),
               np.array([1, 2, 3, 4]), np.array([9]), np.array([1, 3])]
    got = longest_prefixes(prompts)
    # A copy of a prompt is not its prefix; the longest prefix wins (either copy of it).
    assert got[0] == -1 and got[1] == 0 and got[3] == 0 and got[2] in (1, 3)
    assert got[4] == -1 and got[5] == -1


def test_a_prompt_extending_a_captured_one_takes_its_counts_and_predicts_the_rest() -> None:
    rng = np.random.default_rng(0)
    routing = rng.integers(0, 3, (20, 2, 4))  # per token [L, E]
    base = [rng.integers(0, 20, 12) for _ in range(30)]
    prompts = base + [np.concatenate([p, rng.integers(0, 20, 4)]) for p in base[:10]]
    prefill = np.stack([routing[p].sum(axis=0) for p in prompts]).astype(np.float64)
    queries = arrival_queries(prompts, prefill)
    train, test = np.arange(0, 40, 2), np.arange(1, 40, 2)
    out = queries(train, test)
    assert set(out) == {ARRIVAL, ARRIVAL_CACHED}
    for row, i in enumerate(test):
        if i >= 30:  # extends prompt i - 30: its exact counts plus 4 predicted tokens
            error_cached = np.abs(out[ARRIVAL_CACHED][row] - prefill[i]).sum()
            error_cold = np.abs(out[ARRIVAL][row] - prefill[i]).sum()
            assert error_cached < error_cold
        else:
            np.testing.assert_array_equal(out[ARRIVAL_CACHED][row], out[ARRIVAL][row])


def test_without_prompts_extending_others_no_cached_query_is_made() -> None:
    prompts = [np.array([i, i + 1, i + 2]) for i in range(10)]
    prefill = np.ones((10, 2, 4))
    assert set(arrival_queries(prompts, prefill)(np.arange(5), np.arange(5, 10))) == {ARRIVAL}


def test_the_report_shows_the_cached_columns_when_measured() -> None:
    arrival = {
        "predictor": {"tokens": 10, "rank": 2, "ridge": 1.0, "loo_r2": 0.5},
        "label_agreement": 0.5, "label_agreement_cached": 0.8,
        "batches": [{"batch_size": 8, "prefill_change": -0.2, "arrival_change": -0.1,
                     "kept": 0.5, "arrival_cached_change": -0.18, "kept_cached": 0.9}],
    }
    lines = arrival_lines(arrival)
    assert lines[1].split()[-4:] == ["arrival,", "cached", "prefix", "kept"]
    assert lines[2].split() == ["8", "-20.0%", "-10.0%", "50%", "-18.0%", "90%"]
    assert "80% with a cached prefix" in lines[3]


def test_the_gain_kept_with_a_cached_prefix_is_reported_beside_the_cold_one() -> None:
    from stages.fit.arrival_gain import arrival_gain
    from stages.fit.cross_fit import CrossFit
    from stages.fit.gain import GainConfig
    from stages.fit.pipeline import step_profiles
    from stages.fit.token_fit import fit_token_predictor
    from tests.test_fit_gain import IDENTITY, domain_counts

    prefill, decode = domain_counts(seed=0, n=400)
    domain = np.random.default_rng(0).integers(0, 4, 400)  # domain_counts' first draw
    profiles = step_profiles(prefill, decode, IDENTITY)
    # Labelled by domain after prefill and with a cached prefix, at random with nothing cached.
    cold = np.random.default_rng(1).integers(0, 4, 400)
    crossed = CrossFit(labels=domain, folds=5, agreement=1.0,
                       query_labels={ARRIVAL: cold, ARRIVAL_CACHED: domain})
    prompts = [np.arange(i % 7, i % 7 + 5) for i in range(400)]
    token_fit = fit_token_predictor(prompts, prefill.astype(np.float64))
    out = arrival_gain(crossed, profiles, IDENTITY.num_layers, 4,
                       GainConfig(batch_sizes=(8,), num_resamples=200), 0, None, token_fit)
    (row,) = out["batches"]
    assert row["prefill_change"] < 0
    assert row["kept_cached"] == 1.0 and abs(row["kept"]) < 0.3
    assert out["label_agreement_cached"] == 1.0
