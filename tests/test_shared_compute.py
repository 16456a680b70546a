"""Prefill workers that share compute (cores, a GPU) are priced by their group's queue: an idle
worker beside a busy one takes turns with it, so it is not free."""

from __future__ import annotations

import numpy as np
import pytest

from stages.engine import ServerSpec
from stages.errors import EldrError
from stages.paths import BUNDLED_MODELS_DIR
from stages.routing.context import RoutingContext
from stages.routing.policies import make_policy
from stages.routing.policies.base import PrefillRequest
from stages.routing.scorers.prefill_queue import shared_queue
from stages.serve.cluster.launcher import compute_groups, core_plan, shared_compute
from stages.serve.proxy.config import KVConfig
from stages.serve.proxy.view.kv_routing import KVRouting

TINY = str(BUNDLED_MODELS_DIR / "tiny")


def test_workers_on_overlapping_devices_share_one_group() -> None:
    f = frozenset
    assert shared_compute([f({0}), f({0}), f({1}), f({1})]) == (0, 0, 1, 1)
    # Overlap through a third worker joins all three; an unbound worker is alone.
    assert shared_compute([f({0}), f({2}), f({0, 1}), f({1, 2}), f()]) == (0, 0, 0, 0, 1)
    assert shared_compute([f({0, 1}), f({2, 3})]) == (0, 1)


def spec(role: str, port: int, cores: str | None = None, gpus: tuple[int, ...] = ()
         ) -> ServerSpec:
    return ServerSpec(model="m", port=port, role=role, cpu_cores=cores, gpus=gpus)


def test_serves_groups_follow_the_launchers_core_plan_and_gpus() -> None:
    # 2 prefill + 2 decode workers on two cores: each pool on one core (this VM's case).
    roles = ["prefill", "prefill", "decode", "decode"]
    plan = core_plan(roles, [0, 1])
    specs = [spec(r, 8000 + i, cores=c) for i, (r, c) in enumerate(zip(roles, plan, strict=True))]
    assert compute_groups(specs, "prefill") == (0, 0)
    # On four cores each has its own; tensor-parallel ranks count every core they bind.
    plan = core_plan(roles, [0, 1, 2, 3])
    specs = [spec(r, 8000 + i, cores=c) for i, (r, c) in enumerate(zip(roles, plan, strict=True))]
    assert compute_groups(specs, "prefill") == (0, 1)
    ranks = [spec("prefill", 1, cores="0|1"), spec("prefill", 2, cores="1|2"),
             spec("prefill", 3, cores="3")]
    assert compute_groups(ranks, "prefill") == (0, 0, 1)
    gpus = [spec("prefill", 1, gpus=(0,)), spec("prefill", 2, gpus=(0,)),
            spec("prefill", 3, gpus=(1,))]
    assert compute_groups(gpus, "prefill") == (0, 0, 1)


def test_the_proxy_counts_a_groups_whole_queue_on_each_of_its_workers() -> None:
    routing = KVRouting(KVConfig(tokenizer=TINY, prefill_events=(None, None, None),
                                 decode_events=(None,), prefill_compute=(0, 0, 1)))
    routing.prefill_queued[:] = [700, 0, 50]
    loads, queued = routing.prefill_queue(np.array([2, 0, 1]))
    assert loads.tolist() == [2, 2, 1] and queued.tolist() == [700, 700, 50]
    assert routing.state()["prefill_compute_groups"] == [0, 0, 1]  # /admin/state says so
    # Each on its own compute: the queues as they are.
    alone = KVRouting(KVConfig(tokenizer=TINY, prefill_events=(None, None),
                               decode_events=(None,), prefill_compute=(0, 1)))
    alone.prefill_queued[:] = [700, 0]
    loads, queued = alone.prefill_queue(np.array([2, 0]))
    assert loads.tolist() == [2, 0] and queued.tolist() == [700, 0]
    with pytest.raises(EldrError, match="3 compute groups for 2 prefill workers"):
        KVConfig(tokenizer=TINY, prefill_events=(None, None), decode_events=(None,),
                 prefill_compute=(0, 0, 1))


def test_eldr_kv_sends_a_prefill_to_its_cache_holder_when_the_idle_worker_shares_its_core(
) -> None:
    policy = make_policy("eldr-kv", RoutingContext(num_workers=2, seed=0))
    loads, queued = np.array([2, 0]), np.array([1000, 0])
    cached = np.array([900, 0])  # worker 0 holds the history; worker 1 is idle beside it

    def choose(loads: np.ndarray, queued: np.ndarray) -> int:
        return policy.choose_prefill(PrefillRequest(loads, np.ones(2, dtype=bool), 1000,
                                                    cached, queued))

    # Apart (GPU-like cost), the idle worker recomputing the whole prompt (90 ms) looks
    # cheaper than the holder's queue (118 ms); sharing its compute, it waits that queue too.
    assert choose(loads, queued) == 1
    groups = np.array([0, 0])
    assert choose(shared_queue(loads, groups), shared_queue(queued, groups)) == 0


def test_a_tie_between_workers_sharing_compute_goes_to_the_first_of_them() -> None:
    policy = make_policy("eldr-kv", RoutingContext(num_workers=4, seed=0))
    groups = np.array([0, 0, 1, 1])
    cached = np.array([320, 320, 320, 320])  # every worker holds the system prompt
    queued = shared_queue(np.array([0, 0, 500, 0]), groups)
    loads = shared_queue(np.array([0, 0, 1, 0]), groups)

    def choose(eligible: list[bool], compute: np.ndarray | None) -> int:
        return policy.choose_prefill(PrefillRequest(loads, np.array(eligible), 1000, cached,
                                                    queued, compute))

    # Group 0 is idle: always its first worker, where one process batches the group's prefills.
    assert {choose([True] * 4, groups) for _ in range(50)} == {0}
    assert choose([False, True, True, True], groups) == 1
    # Each on its own compute, a tie is drawn at random (both idle workers get some).
    assert {choose([True] * 4, None) for _ in range(50)} == {0, 1}
