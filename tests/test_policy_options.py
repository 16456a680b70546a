"""Policy options: built generically from each policy's dataclass, and every option of every
registered policy settable through `--policy-config`, the admin API and the simulator, so a
field added to a policy's dataclass is the only change a new option needs."""

from __future__ import annotations

from dataclasses import MISSING, asdict, fields
from pathlib import Path

import numpy as np
import orjson
import pytest
from starlette.testclient import TestClient

from eldr_cli.options import policy_config
from stages.errors import EldrError
from stages.routing.context import RoutingContext
from stages.routing.params import ParamError, build_params, option_help, param_types
from stages.routing.policies import POLICIES, make_policy, policy_params
from stages.routing.policy_config import PolicyConfig
from stages.serve.proxy import create_app
from stages.serve.proxy.config import ProxyConfig
from tests.fakes.artifact import domain_artifact

K = 2
# Every (policy, option) the registry declares.
OPTIONS = [(name, key) for name, cls in POLICIES.items() for key in param_types(cls.Params)]


def other_value(name: str, key: str) -> object:
    """A value of option ``key`` of policy ``name`` that it accepts and is not its default."""
    kind = param_types(POLICIES[name].Params)[key]
    default = getattr(policy_params(name), key)
    # Built for the option's type only: the others' arithmetic would fail on its default.
    candidates: list[object] = {
        float: lambda: [default / 2, default * 2, 0.5, 0.0, 1.0],
        int: lambda: [default + 1, default - 1],
        bool: lambda: [not default],
        # eldr-union's cost takes a preset, eldr-kv's decode_choice a moment, its
        # local_prefill_rule a rule
        str: lambda: [f"{default}-other", "gpu", "cpu", "arrival", "holder"],
    }[kind]()
    for value in candidates:
        if value == default:
            continue
        try:
            policy_params(name, {key: value})
        except EldrError:
            continue
        return value
    raise AssertionError(f"no accepted non-default value found for {name} {key}")


def test_the_registry_declares_options() -> None:
    assert ("eldr", "tau") in OPTIONS and ("eldr-bl", "epsilon") in OPTIONS
    assert ("eldr-union", "load_slack") in OPTIONS
    for name, cls in POLICIES.items():
        params = fields(cls.Params)
        assert cls.Params.__dataclass_params__.frozen, name  # type: ignore[attr-defined]
        # Every option has a default (a policy runs with none given) and help for --help.
        assert all(f.default is not MISSING for f in params), name
        assert all(option_help(cls.Params).values()), name
        assert set(param_types(cls.Params).values()) <= {float, int, bool, str}, name


@pytest.mark.parametrize(("name", "key"), OPTIONS)
def test_every_option_is_settable_through_serve_config(name: str, key: str) -> None:
    value = other_value(name, key)
    options = policy_config(orjson.dumps({name: {key: value}}).decode())
    config = ProxyConfig(
        prefill_urls=("http://127.0.0.1:9",), decode_urls=("http://127.0.0.1:10",
                                                           "http://127.0.0.1:11"),
        policy=name, policy_config=options, artifact_store=Path("/a"),
    )
    app = create_app(config, artifact_loader=lambda root, version: domain_artifact(K))
    router = app.state.proxy.router
    assert getattr(router.policy.params, key) == value
    router.set_policy("rr")
    router.set_policy(name)  # kept across a switch away and back
    assert getattr(router.policy.params, key) == value


@pytest.mark.parametrize(("name", "key"), OPTIONS)
def test_every_option_is_settable_through_the_admin_api(name: str, key: str) -> None:
    value = other_value(name, key)
    config = ProxyConfig(
        prefill_urls=("http://127.0.0.1:9",), decode_urls=("http://127.0.0.1:10",
                                                           "http://127.0.0.1:11"),
        policy="rr", artifact_store=Path("/a"),
    )
    app = create_app(config, artifact_loader=lambda root, version: domain_artifact(K))
    with TestClient(app) as client:
        r = client.post("/admin/policy", json={"policy": name, "config": {key: value}})
        assert r.status_code == 200, r.text
        assert r.json()["config"] == asdict(policy_params(name, {key: value}))
        assert client.post("/admin/policy", json={"policy": "rr"}).json()["config"] == {}
        assert client.get("/admin/state").json()["policy_config"] == {name: {key: value}}
        r = client.post("/admin/policy", json={"policy": name})
        assert r.json()["config"][key] == value


@pytest.mark.parametrize(("name", "key"), OPTIONS)
def test_every_option_is_settable_in_the_simulator(
    name: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stages.bench.sim.simulator as simulator
    from stages.bench.sim.synthetic import SyntheticSpec, synthetic_signatures
    from stages.routing.cost_model import gpu_like
    from stages.signature.dataset import ModelIdentity
    from tests.fakes.artifact import FakeArtifact, plain_transform

    value = other_value(name, key)
    spec = SyntheticSpec(num_requests=40, num_layers=2, num_experts=8, top_k=2, num_domains=K,
                         domain_experts=3, min_output=4, max_output=8)
    arrays = synthetic_signatures(spec)
    transform = plain_transform(spec.num_layers, spec.num_experts)

    identity = ModelIdentity("synthetic", spec.num_layers, spec.num_experts, spec.top_k)
    artifact = FakeArtifact("v1", transform.apply(arrays.prefill_counts[:K]), transform,
                            identity)
    built = []

    def spy(policy: str, context: RoutingContext, params: object = None):  # type: ignore[no-untyped-def]
        built.append(made := make_policy(policy, context, params))  # type: ignore[arg-type]
        return made

    monkeypatch.setattr(simulator, "make_policy", spy)
    config = simulator.SimConfig(
        cost=gpu_like(spec.num_layers, spec.num_experts), num_prefill=1, num_decode=K,
        request_rate=20, duration_s=1, policies=(name,),
        policy_config=PolicyConfig.from_mapping({name: {key: value}}),
    )
    simulator.simulate(config, arrays, artifact, top_k=spec.top_k)
    assert [getattr(p.params, key) for p in built] == [value]


# --- the generic builder ------------------------------------------------------------------


def test_unknown_options_and_wrong_types_are_refused_with_the_valid_keys() -> None:
    with pytest.raises(ParamError, match=r"no option 'eps' \(its options: epsilon, tau\)"):
        policy_params("eldr-bl", {"eps": 0.3})
    with pytest.raises(ParamError, match=r"its options: none"):
        policy_params("jsq", {"tau": 0.3})
    with pytest.raises(ParamError, match=r"tau must be a number, got '0\.1'") as caught:
        policy_params("eldr", {"tau": "0.1"})
    assert caught.value.param == "tau"
    with pytest.raises(ParamError, match="must be a number, got True"):
        policy_params("eldr", {"tau": True})
    with pytest.raises(ParamError, match=r"policy 'eldr': tau must be .* <= 1, got 1.5"):
        policy_params("eldr", {"tau": 1.5})
    with pytest.raises(EldrError, match="unknown policy"):
        policy_params("nope")
    assert policy_params("eldr-bl", {"epsilon": 1}).epsilon == 1.0  # an integer is a number
    assert isinstance(policy_params("eldr-bl", {"epsilon": 1}).epsilon, float)


def test_make_policy_applies_overrides_over_the_defaults() -> None:
    context = RoutingContext(2, centroids=np.eye(2, dtype=np.float32))
    p = make_policy("eldr-bl", context, {"epsilon": 0.5})
    assert asdict(p.params) == {"tau": 0.1, "epsilon": 0.5}
    assert make_policy("eldr-bl", context).params == policy_params("eldr-bl")


def test_build_params_knows_no_policy() -> None:
    from dataclasses import dataclass

    from stages.routing.params import option

    @dataclass(frozen=True)
    class Made:
        count: int = option(1, "how many")
        flag: bool = option(False, "whether")
        label: str = option("a", "what")

    assert build_params(Made, {"count": 3, "flag": True, "label": "b"}, "x") == Made(3, True, "b")
    with pytest.raises(ParamError, match=r"count must be an integer, got 1\.5"):
        build_params(Made, {"count": 1.5}, "x")
    with pytest.raises(ParamError, match="flag must be true or false, got 1"):
        build_params(Made, {"flag": 1}, "x")


# --- the keyed config --------------------------------------------------------------------


def test_policy_config_keeps_what_was_given_per_policy() -> None:
    config = PolicyConfig.from_json('{"eldr-bl": {"epsilon": 1}, "eldr": {"tau": 0.05}}')
    assert config.to_json() == {"eldr": {"tau": 0.05}, "eldr-bl": {"epsilon": 1.0}}
    assert config.overrides("rr") == {}
    updated = config.updated("eldr-bl", {"tau": 0.2})
    assert updated.overrides("eldr-bl") == {"epsilon": 1.0, "tau": 0.2}
    assert config.overrides("eldr-bl") == {"epsilon": 1.0}  # a new value, this one unchanged
    assert hash(config) == hash(PolicyConfig.from_mapping({"eldr": {"tau": 0.05},
                                                           "eldr-bl": {"epsilon": 1.0}}))
    with pytest.raises(EldrError, match="epsilon"):
        config.updated("eldr-bl", {"epsilon": -1})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{bad", "--policy-config: the policy config is not JSON"),
        ("[1]", "--policy-config: the policy config must be a JSON object keyed by policy"),
        ('{"eldr": 0.1}', "--policy-config: the options of policy 'eldr' must be a JSON object"),
        ('{"x": {}}', "--policy-config: unknown policy 'x'"),
        ('{"eldr": {"tau": -1}}', "--policy-config: policy 'eldr': tau must be a finite"),
    ],
)
def test_policy_config_option_refusals(text: str, message: str) -> None:
    with pytest.raises(EldrError, match="^" + message.replace("(", r"\(")):
        policy_config(text)


def test_a_deployment_default_fills_only_what_the_user_left_unsaid() -> None:
    given = PolicyConfig.from_json('{"eldr-kv": {"cost": "gpu"}}')
    config = given.with_default("cost", "cpu")
    assert config.overrides("eldr-kv")["cost"] == "gpu"  # the user's word stands
    with_cost = {name for name, cls in POLICIES.items()
                 if "cost" in {f.name for f in fields(cls.Params)}}
    assert {"eldr-union", "eldr-kv"} <= with_cost
    for name in with_cost - {"eldr-kv"}:
        assert config.overrides(name) == {"cost": "cpu"}
    for name in set(POLICIES) - with_cost:  # load balancers have no cost to set
        assert config.overrides(name) == {}


def test_serve_prices_workers_it_starts_on_cpus_with_the_cpu_preset() -> None:
    from stages.serve.deploy import _platform_defaults

    assert _platform_defaults(PolicyConfig(), attached=False, cpu=True).overrides(
        "eldr-kv") == {"cost": "cpu"}
    assert _platform_defaults(PolicyConfig(), attached=False, cpu=False) == PolicyConfig()
    # Attached workers may be GPUs whatever the proxy's machine is.
    assert _platform_defaults(PolicyConfig(), attached=True, cpu=True) == PolicyConfig()
