"""eldr-kv's compiled decode objective (``kv_kernels``) against the scorers it restates: the same
bits on random cases, and the same choices and random draws as the scorers' numpy composition
it replaced, over many random requests."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import pytest

from stages.routing.context import RoutingContext
from stages.routing.policies import PrefillRequest, RoutingRequest, kv_kernels, make_policy
from stages.routing.policies.eldr_kv import EldrKvPolicy, KVParams, _cheapest
from stages.routing.policies.eldr_union import EldrUnionPolicy
from stages.routing.policies.union_kernels import TIE
from stages.routing.scorers.kv_pull import kv_pull_s
from stages.routing.scorers.load import added_step_s
from stages.routing.scorers.prefill_queue import prefill_ready_s
from stages.routing.scorers.residual_load import shared_load
from stages.routing.scorers.step_wait import step_wait_s

CASES = 10_000


def _rows(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Random in-flight rows as ``EldrKvPolicy`` keeps them (-1: a free row)."""
    workers = int(rng.integers(1, 17))
    size = int(rng.choice([1, 4, 64, 128]))
    worker = rng.integers(-1, workers, size=size)
    worker[rng.random(size) < rng.random()] = -1
    decisions = int(rng.integers(0, 5000))
    joined = rng.integers(0, decisions + 1, size=size).astype(np.float64)
    tokens = rng.choice([0, 1, 7, 64, 256, 511, 4096], size=size).astype(np.float64)
    if rng.random() < 0.2:
        tokens[:] = 0.0  # no request in flight set max_tokens
    return worker, joined, tokens, decisions, workers


def test_residual_load_kernel_equals_the_scorer_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    for _ in range(CASES):
        worker, joined, tokens, decisions, workers = _rows(rng)
        new_tokens = int(rng.choice([1, 16, 64, 256, 1000]))
        live = worker >= 0
        expected = shared_load(worker[live], decisions - joined[live], tokens[live], new_tokens,
                               workers)
        beside = np.full(workers, np.nan)
        kv_kernels.residual_load(worker, joined, tokens, decisions, new_tokens, beside)
        np.testing.assert_array_equal(beside, expected)


def _composed_seconds(beside: np.ndarray, latency: np.ndarray, added: np.ndarray,
                      distinct: np.ndarray, step: np.ndarray, loads: np.ndarray, tokens: int,
                      prompt_tokens: int, cached: np.ndarray | None,
                      pull_s: float) -> np.ndarray:
    """The decode objective as ``eldr_kv`` composed it from the scorers before the kernel."""
    fixed, per_seq, per_expert = step
    per_token = (fixed + per_seq * beside + per_expert * distinct
                 + (beside + 1.0) * (per_seq + per_expert * added))
    total = np.where(np.isinf(latency), np.inf, per_token) * tokens
    total += step_wait_s(loads, fixed + per_seq * loads + per_expert * distinct)
    total += kv_pull_s(prompt_tokens, cached, pull_s)
    return total


def _composed_ties(total: np.ndarray, eligible: np.ndarray) -> tuple[int, int]:
    idx = np.flatnonzero(eligible)
    low = min(total[idx].tolist()) * (1.0 + TIE)
    best = [int(w) for w in idx if total[w] <= low]
    return len(best), best[0]


def test_decode_seconds_kernel_equals_the_composed_scorers_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    seen_ties = seen_pulls = seen_inf = 0
    for _ in range(CASES):
        workers = int(rng.integers(1, 17))
        loads = rng.integers(0, 4, size=workers)
        # Equal values often (ties), arbitrary ones otherwise (every rounding shows).
        discrete = rng.random() < 0.3
        beside = (rng.choice([0.0, 0.25, 1.0], size=workers) if discrete
                  else rng.random(workers) * 8)
        distinct = rng.choice([0.0, 40.0], size=workers) if discrete else rng.random(workers) * 128
        added = rng.choice([0.0, 3.0], size=workers) if discrete else rng.random(workers) * 20
        latency = np.where(rng.random(workers) < 0.2, np.inf, 1.0)
        eligible = rng.random(workers) < 0.8
        eligible[rng.integers(workers)] = True
        step = rng.random(3) * [0.02, 2e-4, 4e-5]
        tokens = int(rng.choice([1, 64, 256]))
        prompt_tokens = int(rng.choice([0, 256, 2000]))
        cached = None if rng.random() < 0.25 else rng.choice([0, 128, 2048], size=workers)
        pull_s = float(rng.choice([0.0, rng.random() * 3e-5]))
        expected = _composed_seconds(beside, latency, added, distinct, step, loads, tokens,
                                     prompt_tokens, cached, pull_s)
        total = np.full(workers, np.nan)
        ties, first = kv_kernels.decode_seconds(
            beside, latency, added, distinct, step, loads, eligible, tokens, prompt_tokens,
            kv_kernels.NO_CACHED if cached is None else cached, pull_s, total)
        np.testing.assert_array_equal(total, expected)
        assert (ties, first) == _composed_ties(expected, eligible)
        seen_ties += ties > 1
        seen_pulls += cached is not None and prompt_tokens > 0 and pull_s > 0
        seen_inf += bool(np.isinf(expected[eligible]).all())
    assert min(seen_ties, seen_pulls, seen_inf) > 100  # the cases covered every branch


def test_cheapest_ties_keeps_the_tie_margin() -> None:
    """Workers within ``TIE`` of the least tie (a random draw among them), those beyond not."""
    rng = np.random.default_rng(2)
    for _ in range(CASES):
        workers = int(rng.integers(1, 9))
        total = rng.random() * (1.0 + rng.choice([0.0, 5e-10, 1e-9, 2e-9, 1e-8], size=workers))
        total[rng.random(workers) < 0.1] = np.inf
        eligible = rng.random(workers) < 0.8
        eligible[rng.integers(workers)] = True
        assert kv_kernels.cheapest_ties(total, eligible) == _composed_ties(total, eligible)


class _ComposedEldrKv(EldrKvPolicy):
    """eldr-kv's decode choice as it was composed of the scorers' numpy functions before the
    kernel (commit 85946bd): the reference the compiled policy must choose as."""

    def choose(self, request: RoutingRequest) -> int:
        total = self._composed_decode_seconds(request)
        if total is None:
            return EldrUnionPolicy.choose(self, request)
        total += kv_pull_s(request.prompt_tokens, request.cached_tokens,
                           self._costs().kv_transfer_per_token_s)
        return _cheapest(total, request.eligible, self.rng)

    def choose_local(self, request: RoutingRequest, prefill: PrefillRequest) -> int | None:
        cap = self.params.local_prefill_below
        if cap <= 0 or request.cached_tokens is None or request.prompt_tokens <= 0:
            return None
        stay = self._composed_decode_seconds(request)
        if stay is None:
            return None
        cost = self._costs()
        lacking = np.maximum(request.prompt_tokens - request.cached_tokens, 0)
        local = stay + (request.loads + 1) * cost.prefill_per_token_s * lacking
        local[lacking >= cap] = np.inf
        ready = prefill_ready_s(prefill.prompt_tokens, prefill.cached_tokens,
                                prefill.queued_tokens, prefill.loads, cost)
        ready[~prefill.eligible] = np.inf
        remote = stay + cost.kv_transfer_per_token_s * lacking + float(ready.min())
        worker = _cheapest(local, request.eligible, self.rng)
        return worker if local[worker] < remote[request.eligible].min() else None

    def _composed_decode_seconds(self, request: RoutingRequest) -> np.ndarray | None:
        loads, eligible = request.loads, request.eligible
        tokens = request.output_tokens or self.params.output_tokens
        pi = self._predict(request)
        if pi is None:
            pi = self._typical_pi()
        total = self._total
        live = self._worker >= 0
        beside = shared_load(self._worker[live], self._decisions - self._joined[live],
                             self._tokens[live], tokens, self.num_workers)
        if pi is not None:
            ties, _ = self._score(request, pi, self.params.load_slack)
            if ties == 0:
                return None
            assert self._load is not None and self._step is not None
            fixed, per_seq, per_expert = self._step
            per_token = (fixed + per_seq * beside + per_expert * self._load.distinct
                         + (beside + 1.0) * (per_seq + per_expert * self._added))
            np.multiply(np.where(np.isinf(self._latency), np.inf, per_token), tokens, out=total)
            running = fixed + per_seq * loads + per_expert * self._load.distinct
        else:
            total[:] = tokens * added_step_s(beside, self._costs(), distinct=0.0)
            total[~self._admits(loads, eligible)] = np.inf
            running = self._costs().step_time(loads, 0.0)
        total += step_wait_s(loads, running)
        return total


def _policies(workers: int, seed: int, slots: int | None,
              local: int) -> tuple[EldrKvPolicy, EldrKvPolicy]:
    context = RoutingContext(workers, seed=seed, top_k=2, worker_slots=slots)
    params = {"cost": "gpu", "local_prefill_below": local, "sample_layers": 2}
    compiled = make_policy("eldr-kv", context, params)
    assert isinstance(compiled, EldrKvPolicy)
    return compiled, _ComposedEldrKv(context, KVParams(**params))


@pytest.mark.parametrize("workers", [1, 2, 3, 5, 16])
def test_choices_and_draws_equal_the_scorers_composition(workers: int) -> None:
    """Random requests (a signature, none, or none yet seen; known, unknown or no cached KV;
    ineligible and full workers) dispatched and completed at random: the compiled policy picks
    every worker the composition picks, draws the same random numbers, and prices alike."""
    rng = np.random.default_rng(workers)
    decisions = ties_drawn = local_taken = 0
    for seed in range(8):
        slots = None if seed % 2 else 3
        compiled, composed = _policies(workers, seed, slots, local=0 if seed < 4 else 1500)
        loads = np.zeros(workers, dtype=np.int64)
        running: list[tuple[Hashable, int]] = []
        signed_from = int(rng.integers(0, 40))  # decisions before the first signature
        for step in range(300):
            counts = None
            if step >= signed_from and rng.random() < 0.8:
                counts = rng.integers(0, 3, size=(4, 8)).astype(np.int16)
                if rng.random() < 0.1:
                    counts[:] = 0  # a uniform signature: exact ties
            eligible = rng.random(workers) < 0.85
            eligible[rng.integers(workers)] = True
            cached = None if rng.random() < 0.2 else rng.choice([0, 256, 1024, 2048],
                                                                size=workers)
            request = RoutingRequest(
                loads=loads.copy(), eligible=eligible, counts=counts,
                prompt_tokens=int(rng.choice([0, 300, 2048])), cached_tokens=cached,
                output_tokens=int(rng.choice([0, 1, 64, 512])))
            before = compiled.rng.bit_generator.state
            if compiled.prefills_locally and cached is not None and rng.random() < 0.5:
                prefill = PrefillRequest(np.zeros(2, dtype=np.int64), np.ones(2, dtype=bool),
                                         request.prompt_tokens, np.array([0, 1024]),
                                         np.array([0, 4096]))
                worker = compiled.choose_local(request, prefill)
                assert worker == composed.choose_local(request, prefill)
                local_taken += worker is not None
            else:
                worker = compiled.choose(request)
                assert worker == composed.choose(request)
            assert compiled.rng.bit_generator.state == composed.rng.bit_generator.state
            ties_drawn += compiled.rng.bit_generator.state != before
            np.testing.assert_array_equal(compiled._total, composed._total)
            decisions += 1
            if worker is None:
                continue
            for policy in (compiled, composed):
                policy.on_dispatch(worker, request, step)
            loads[worker] += 1
            running.append((step, worker))
            while running and (len(running) > 3 * workers or rng.random() < 0.3):
                key, done = running.pop(int(rng.integers(len(running))))
                for policy in (compiled, composed):
                    policy.on_complete(done, key)
                loads[done] -= 1
    assert decisions == 8 * 300
    if workers > 1:
        assert ties_drawn > 20  # random tie breaks were compared, not only unique picks
        assert local_taken > 0
