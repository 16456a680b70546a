"""eldr-kv's local-prefill rule 'holder': the decode worker holding the most of a prompt
prefills it itself when it runs few requests sharing few of the new one's decode steps."""

from __future__ import annotations

import numpy as np
import pytest

from stages.bench.sim.conversation_sim import ConversationSimConfig, simulate_outcomes
from stages.bench.sim.conversation_workload import SimConversationSpec
from stages.bench.sim.decode_choice_study import HolderSweep, print_holder_table, run_seed
from stages.errors import EldrError
from stages.routing.context import RoutingContext
from stages.routing.cost_model import gpu_like
from stages.routing.policies import PrefillRequest, RoutingRequest, make_policy
from stages.routing.policy_config import PolicyConfig
from tests.sim_arrays import EXPERTS, LAYERS, TOP_K
from tests.sim_arrays import arrays as arrays  # a fixture, used by name

ALL = np.ones(3, dtype=bool)
PREFILL = PrefillRequest(loads=np.zeros(2, dtype=np.int64), eligible=np.ones(2, dtype=bool),
                         prompt_tokens=2000, cached_tokens=np.array([1536, 0]),
                         queued_tokens=np.zeros(2, dtype=np.int64))


def _holder_policy(**params: object):
    return make_policy("eldr-kv", RoutingContext(3, seed=0, top_k=2),
                       {"cost": "gpu", "local_prefill_below": 512, "local_prefill_rule": "holder",
                        **params})


def _turn(loads: tuple[int, int, int] = (0, 0, 0), tokens: int = 256) -> RoutingRequest:
    """A later turn whose history worker 1 holds: it lacks 208 of 2,000 tokens there."""
    return RoutingRequest(loads=np.array(loads, dtype=np.int64), eligible=ALL, prompt_tokens=2000,
                          cached_tokens=np.array([0, 1792, 0]), output_tokens=tokens)


def _running_on_holder(policy, decisions_since: int = 0) -> None:
    """Ten requests of 256 tokens in flight on workers 0 and 2 (residual load's clock: a
    request lasts as many decisions as are in flight), then one on worker 1, then
    ``decisions_since`` more dispatched to worker 0 and completed."""
    for key in range(10):
        policy.on_dispatch(2 * (key % 2), _turn(), ("beside", key))
    policy.on_dispatch(1, _turn(), "running")
    for key in range(decisions_since):
        policy.on_dispatch(0, _turn(), key)
        policy.on_complete(0, key)


def test_an_idle_holder_prefills_however_busy_the_others_are() -> None:
    # The priced rule would send this turn remote: a busy cluster's mean request is unknown.
    assert _holder_policy().choose_local(_turn(loads=(5, 0, 5)), PREFILL) == 1


def test_a_holder_running_more_than_allowed_does_not() -> None:
    policy = _holder_policy()
    _running_on_holder(policy)
    assert policy.choose_local(_turn(loads=(5, 1, 5)), PREFILL) is None  # shares every step
    loose = _holder_policy(local_prefill_shared=1.0)
    _running_on_holder(loose)
    assert loose.choose_local(_turn(loads=(5, 1, 5)), PREFILL) == 1
    assert loose.choose_local(_turn(loads=(5, 2, 5)), PREFILL) is None  # runs two


def test_the_shared_bound_reads_the_steps_the_running_request_has_left() -> None:
    """A running request that will share most of the new turn's steps keeps it remote; one
    about to end (by the decisions since it joined) lets the holder prefill."""
    fresh = _holder_policy(local_prefill_shared=0.25)
    _running_on_holder(fresh)
    assert fresh.choose_local(_turn(loads=(5, 1, 5)), PREFILL) is None
    ending = _holder_policy(local_prefill_shared=0.25)
    _running_on_holder(ending, decisions_since=8)
    assert 0 < ending._beside(_turn(), 256)[1] <= 0.25  # 2 of its 11 decisions left
    assert ending.choose_local(_turn(loads=(5, 1, 5)), PREFILL) == 1


def test_a_holder_lacking_the_cap_or_more_does_not() -> None:
    assert _holder_policy(local_prefill_below=208).choose_local(_turn(), PREFILL) is None
    assert _holder_policy(local_prefill_below=209).choose_local(_turn(), PREFILL) == 1
    assert _holder_policy(local_prefill_below=0).choose_local(_turn(), PREFILL) is None


def test_an_ineligible_holder_is_not_chosen() -> None:
    request = _turn()._replace(eligible=np.array([True, False, True]))
    assert _holder_policy(local_prefill_below=4096).choose_local(request, PREFILL) in (0, 2)
    assert _holder_policy(local_prefill_below=512).choose_local(request, PREFILL) is None


@pytest.mark.parametrize(("option", "value", "message"), [
    ("local_prefill_rule", "nearest", "local_prefill_rule must be one of cost, holder"),
    ("local_prefill_running", -1, "local_prefill_running must be >= 0"),
    ("local_prefill_shared", -0.5, "local_prefill_shared must be a finite number >= 0"),
])
def test_bad_rule_options_are_refused_with_a_message(option: str, value: object,
                                                     message: str) -> None:
    with pytest.raises(EldrError, match=message):
        PolicyConfig.from_mapping({"eldr-kv": {option: value}})


def _simulate(arrays, **options: object):  # type: ignore[no-untyped-def]
    spec = SimConversationSpec(conversations=60, turns=3, conversation_rate=6.0,
                               think_time_s=0.5, system_prompts=2, system_tokens=64,
                               message_tokens=48, output_tokens=32, max_model_len=4096)
    config = ConversationSimConfig(
        cost=gpu_like(LAYERS, EXPERTS), workload=spec, num_prefill=2, num_decode=4,
        policies=("eldr-kv",), policy_config=PolicyConfig.from_mapping({"eldr-kv": options}))
    turns, out, _ = simulate_outcomes(config, arrays, TOP_K)
    return turns, out["eldr-kv"]


def test_the_simulator_sends_turns_local_only_to_holders_running_few(arrays) -> None:  # type: ignore[no-untyped-def]
    rule = {"local_prefill_rule": "holder", "local_prefill_below": 4096}
    turns, one = _simulate(arrays, local_prefill_running=1, local_prefill_shared=1.0, **rule)
    local = one.prefill_worker < 0
    assert np.isfinite(one.done).all()
    assert local[turns.turn >= 2].any()
    assert (one.holder_load[local] <= 1).all()
    assert (one.decode_pulled[local] == 0).all()
    _, idle = _simulate(arrays, local_prefill_running=0, local_prefill_shared=0.0, **rule)
    assert (idle.holder_load[idle.prefill_worker < 0] == 0).all()
    assert (idle.prefill_worker < 0).sum() <= local.sum()


def test_the_study_compares_the_rule_with_always_remote_seed_by_seed(arrays, capsys) -> None:  # type: ignore[no-untyped-def]
    spec = SimConversationSpec(conversations=40, turns=3, conversation_rate=6.0,
                               think_time_s=0.5, system_prompts=2, system_tokens=64,
                               message_tokens=48, output_tokens=32, max_model_len=4096)
    base = ConversationSimConfig(cost=gpu_like(LAYERS, EXPERTS), workload=spec, num_prefill=2,
                                 num_decode=4)
    sweep = HolderSweep(shared=(1.0, 0.0), running=1, below=4096, only=True)
    row = run_seed(base, arrays, TOP_K, None, (), sweep)
    assert "kept" not in row  # only: no load balancers, no expert gain
    for choice in ("after-prefill", "arrival"):
        loose, idle = (f"{choice}_holder1", f"{choice}_holder0")
        assert row[f"{loose}_share_later"] >= row[f"{idle}_share_later"]
        assert row[f"{loose}_share_later"] > 0
        assert np.isfinite([row[f"{loose}_ttft_later_p50_x"], row[f"{loose}_tpot_p99_x"]]).all()
    print_holder_table([row], sweep)
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("rule 'holder' (running <= 1, lacking < 4096)")
    assert len(table) == 5 and table[1].startswith("after-prefill shared <= 1: ")


def test_the_study_gives_each_mean_its_95_percent_interval_over_seeds() -> None:
    from stages.bench.sim.decode_choice_study import _ci95

    # Five seeds 0.96-1.00: mean 0.98, sd 0.0158, t(0.975, 4) = 2.776 -> 0.0196.
    assert _ci95(np.array([0.96, 0.97, 0.98, 0.99, 1.00])) == " ± 0.02"
    assert _ci95(np.array([0.97])) == ""  # one seed has no interval
