"""The `eldr` CLI: help, defaults, and clear errors for user mistakes (heavy calls mocked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eldr_cli.app import app
from stages import paths
from tests.conftest import free_port

runner = CliRunner()


def run_eldr(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ELDR_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "eldr_cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_help_lists_every_stage() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("capture", "fit", "serve", "bench", "artifacts", "models"):
        assert command in result.output


def test_the_cli_starts_without_the_engine_or_compiler_imported() -> None:
    # `eldr --help` and every command's start stay quick: torch, vLLM and numba (eldr-union's
    # kernels, ~1 s to import) come in only with the work that needs them.
    code = ("import sys, eldr_cli.app; print(sorted({'torch', 'vllm', 'numba'}"
            " & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["capture", "fit", "serve", "bench"])
def test_every_option_is_documented(command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    import click

    cmd = typer_command(command)
    for param in cmd.params:
        if isinstance(param, click.Option) and param.name != "help":
            assert param.help, f"{command} --{param.name} has no help"


def typer_command(name: str):  # type: ignore[no-untyped-def]
    import typer.main

    group = typer.main.get_command(app)
    return group.commands[name]  # type: ignore[attr-defined]


def test_serve_mixtral_without_weights_names_the_bundled_model(tmp_path: Path) -> None:
    result = run_eldr("serve", "--model", "mixtral", home=tmp_path)
    assert result.returncode == 2
    assert "mistralai/Mixtral-8x7B-Instruct-v0.1" in result.stderr
    assert "--model tiny" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_policy_config_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    for command in ("serve", "bench"):
        result = run_eldr(command, "--policy-config", '{"eldr": {"tau": 2}}', home=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == (
            "eldr: --policy-config: policy 'eldr': tau must be a finite number >= 0 and <= 1,"
            " got 2.0"
        )


def test_fit_without_dataset_says_to_capture(tmp_path: Path) -> None:
    result = run_eldr("fit", "--k", "20", "--balanced", home=tmp_path)
    assert result.returncode == 2
    assert "eldr capture" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_eldr_without_artifact_says_how_to_make_one(tmp_path: Path) -> None:
    result = run_eldr("serve", "--model", "tiny", "--policy", "eldr", home=tmp_path)
    assert result.returncode == 2
    assert "eldr fit --k 2" in result.stderr


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    result = run_eldr("capture", "--model", "no-such-model", home=tmp_path)
    assert result.returncode == 2
    assert "unknown model 'no-such-model'" in result.stderr


def test_malformed_prompt_file_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x", "domain": "d"}\nnot json\n')
    result = run_eldr("capture", "--prompts", str(bad), home=tmp_path)
    assert result.returncode == 2
    assert f"{bad}:2" in result.stderr


def test_capture_defaults_reach_the_runner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`eldr capture` with no options: bundled model, calibration prompts, default dataset."""
    import stages.capture.runner as capture_runner
    from stages.capture.runner import CaptureSummary

    seen = {}

    def fake_capture(model, prompts, out, config, probe, progress=None, status=None):  # type: ignore[no-untyped-def]
        seen.update(model=model, prompts=prompts, out=out, config=config)
        # vLLM's engine processes write to the inherited descriptors, not to sys.stdout.
        os.write(2, b"a vLLM log line that must not reach the terminal\n")
        return CaptureSummary(out, len(prompts), 0, len(prompts))

    monkeypatch.setattr(capture_runner, "capture", fake_capture)
    monkeypatch.setenv("ELDR_HOME", str(tmp_path))
    result = runner.invoke(app, ["capture"])
    assert result.exit_code == 0, result.output
    assert "must not reach" not in result.output
    [log] = (tmp_path / "logs").glob("capture-*.log")
    assert "a vLLM log line" in log.read_text()
    assert str(log) in result.output
    assert seen["model"].name == "tiny"
    assert seen["out"] == tmp_path.resolve() / "signatures.zarr"
    assert len(seen["prompts"]) == sum(1 for _ in paths.CALIBRATION_PROMPTS.open())
    assert seen["config"].max_tokens == 32
    assert not seen["config"].enforce_eager  # vLLM's default compiled mode
    result = runner.invoke(app, ["capture", "--enforce-eager"])
    assert result.exit_code == 0, result.output
    assert seen["config"].enforce_eager


def test_worker_args_print_the_connector_flag() -> None:
    import json
    import shlex

    result = runner.invoke(app, ["worker-args", "decode"])
    assert result.exit_code == 0, result.output
    flag, value = shlex.split(result.output)
    assert flag == "--kv-transfer-config"
    connectors = json.loads(value)["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in connectors] == ["EldrSignatureConnector", "NixlConnector"]
    assert runner.invoke(app, ["worker-args", "bogus"]).exit_code != 0


def test_bench_prints_the_comparison_table_and_plots(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`eldr bench` end to end over a stubbed load run (the real one is in the demo)."""
    import stages.bench.live.loadgen as loadgen
    from stages.bench.results import ComparisonResult
    from stages.bench.sim.simulator import SimConfig, simulate
    from stages.bench.sim.synthetic import SyntheticSpec, stand_in_artifact, synthetic_signatures
    from stages.routing.cost_model import gpu_like

    spec = SyntheticSpec(num_requests=200, num_layers=4, num_experts=16, top_k=2,
                         domain_experts=6, min_output=8, max_output=16)
    arrays = synthetic_signatures(spec)
    artifact = stand_in_artifact(arrays, 2, calibration=100, iters=5, num_pairs=500)
    config = SimConfig(cost=gpu_like(4, 16), num_prefill=1, num_decode=2, request_rate=5,
                       duration_s=5)
    results = simulate(config, arrays, artifact, top_k=2)
    seen = {}

    def fake_sweep(bench_config, rates):  # type: ignore[no-untyped-def]
        seen["config"] = bench_config
        return [ComparisonResult(rates[0], results)]

    monkeypatch.setattr(loadgen, "run_rate_sweep", fake_sweep)
    monkeypatch.setenv("ELDR_HOME", str(tmp_path))
    result = runner.invoke(app, ["bench", "--request-rate", "5"])
    assert result.exit_code == 0, result.output
    assert seen["config"].url == paths.DEFAULT_PROXY_URL
    assert seen["config"].prompts_path == paths.EVALUATION_PROMPTS
    assert "best baseline" in result.output
    for policy in ("eldr", "rr", "jsq", "random", "p2c"):
        assert f"\n{policy} " in result.output


def test_prefill_model_must_route_like_the_decode_model(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    config = (paths.BUNDLED_MODELS_DIR / "tiny" / "config.json").read_text()
    (other / "config.json").write_text(config.replace('"eldr_routing_id": "tiny"',
                                                      '"eldr_routing_id": "other"'))
    result = run_eldr("serve", "--model", "tiny", "--prefill-model", str(other),
                      "--policy", "jsq", home=tmp_path)
    assert result.returncode == 2
    assert "does not route like" in result.stderr
    assert "Traceback" not in result.stderr


def test_prefill_model_must_share_kv_shapes(tmp_path: Path) -> None:
    import json

    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((paths.BUNDLED_MODELS_DIR / "tiny" / "config.json").read_text())
    config["num_key_value_heads"] = config["num_attention_heads"] * 2
    (other / "config.json").write_text(json.dumps(config))
    result = run_eldr("serve", "--model", "tiny", "--prefill-model", str(other),
                      "--policy", "jsq", home=tmp_path)
    assert result.returncode == 2
    assert "num_key_value_heads" in result.stderr


def test_version_names_eldr_and_vllm() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("eldr ") and "vLLM" in result.output


def test_bench_without_a_proxy_points_to_serve(tmp_path: Path) -> None:
    result = run_eldr("bench", "--url", f"http://127.0.0.1:{free_port()}", home=tmp_path)
    assert result.returncode == 2
    assert "eldr serve" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_simulate_takes_proxies_and_their_publish_delay(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--proxies and --publish-delay-ms reach the simulation's options (the run mocked); a
    replay, which reproduces a live run's one proxy, refuses them."""
    import stages.bench.sim.simulate_run as simulate_run
    from stages.errors import EldrError

    seen = []
    monkeypatch.setattr(simulate_run, "run_simulate", lambda options, echo: seen.append(options))
    monkeypatch.setenv("ELDR_HOME", str(tmp_path))
    result = runner.invoke(app, ["bench", "--simulate", "--proxies", "4",
                                 "--publish-delay-ms", "5"])
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["bench", "--simulate"]).exit_code == 0
    assert [(o.proxies, o.publish_delay_ms) for o in seen] == [(4, 5.0), (1, 0.0)]
    for bad in (["--proxies", "0"], ["--publish-delay-ms", "-1"]):
        assert runner.invoke(app, ["bench", "--simulate", *bad]).exit_code == 2
    replay = runner.invoke(app, ["bench", "--simulate", "--replay", str(tmp_path),
                                 "--proxies", "2"])
    assert isinstance(replay.exception, EldrError)
    assert "not a --replay" in str(replay.exception)


def test_bench_simulate_records_its_proxies(tmp_path: Path) -> None:
    """A small simulation end to end: the title and each policy's results file say how many
    proxies routed and how stale their views were."""
    import orjson

    from stages.bench.sim.synthetic import SyntheticSpec, synthetic_signatures
    from stages.signature.dataset import ModelIdentity
    from tests.conftest import write_dataset

    spec = SyntheticSpec(num_requests=50, num_layers=4, num_experts=16, top_k=2,
                         domain_experts=6, min_output=8, max_output=16)
    arrays = synthetic_signatures(spec)
    identity = ModelIdentity(name="syn", num_layers=4, num_experts=16, top_k=2)
    write_dataset(tmp_path / "sig.zarr", arrays, identity)
    out = tmp_path / "results"
    result = runner.invoke(app, [
        "bench", "--simulate", "--data", str(tmp_path / "sig.zarr"), "--policies", "jsq",
        "--prefill", "1", "--decode", "2", "--duration", "3", "--cost", "cpu",
        "--request-rate", "5", "--proxies", "3", "--publish-delay-ms", "20",
        "--result-dir", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert "simulated 1P2D behind 3 proxies (20 ms publish delay), 5 req/s" in result.output
    doc = orjson.loads((out / "jsq-5qps.json").read_bytes())
    assert (doc["proxies"], doc["publish_delay_ms"]) == (3, 20.0)


def test_serve_passes_engine_args_and_served_name_to_the_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import stages.serve.cluster.launcher as launcher
    from stages.errors import EldrError

    seen = {}

    class FakeCluster:
        def __init__(self, spec: launcher.ClusterSpec) -> None:
            seen["spec"] = spec
            self.spec = spec
            self.specs: list[object] = []
            self.prefill_urls, self.decode_urls = ["http://127.0.0.1:1"], ["http://127.0.0.1:2"]
            self.decode_batch_endpoints = ["tcp://127.0.0.1:3"]

        expert_event_endpoints: list[str | None] = []  # noqa: RUF012

        def compute_groups(self, role: str) -> tuple[int, ...]:
            return ()

        def kv_event_endpoints(self, role: str) -> list[str | None]:
            return [None]

        def start(self, on_ready=None) -> None:  # type: ignore[no-untyped-def]
            raise EldrError("stopped before starting vLLM")

        def stop(self) -> None:
            seen["stopped"] = True

    monkeypatch.setattr(launcher, "Cluster", FakeCluster)
    monkeypatch.setenv("ELDR_HOME", str(tmp_path))
    result = runner.invoke(app, ["serve", "--policy", "rr", "--port", str(free_port()),
                                 "--served-model-name", "my-moe",
                                 "--vllm-arg", "--dtype=half",
                                 "--vllm-arg=--gpu-memory-utilization 0.8"])
    assert isinstance(result.exception, EldrError), result.output
    spec = seen["spec"]
    assert spec.extra_args == ("--dtype=half", "--gpu-memory-utilization", "0.8")
    assert spec.served_name == "my-moe"
    assert seen["stopped"]  # whatever happens after the launch starts, workers are stopped


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vllm-arg=--port 9000"], "use --worker-port"),
        (["--vllm-arg=--kv-transfer-config={}"], "eldr sets --kv-transfer-config itself"),
        (["--vllm-arg=dtype"], "pass vLLM flags"),
        (["--vllm-arg=-tp 2"], "use --prefill-tp / --decode-tp"),
        (["--vllm-arg=--data-parallel-size 2"], "data parallel (--data-parallel-size 2)"),
        (["--vllm-arg=-dp=2 --enable-expert-parallel"], "data parallel"),
        (["--vllm-arg=--enable-dbo"], "micro-batching"),
        (["--vllm-arg=--enable-expert-parallel"], "expert parallel (--enable-expert-parallel)"),
        (["--vllm-arg=--pipeline-parallel-size 2"], "pipeline parallel"),
        (["--vllm-arg=--decode-context-parallel-size two"], "invalid int value"),
        (["--log-level", "loud"], "use debug, info, warning or error"),
        (["--api-key", " spaced "], "--api-key must be printable ASCII"),
    ],
)
def test_serve_refuses_engine_args_eldr_owns(
    args: list[str], message: str, tmp_path: Path
) -> None:
    result = run_eldr("serve", "--policy", "rr", *args, home=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_on_an_open_address_without_a_key_is_refused_unless_insecure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import stages.serve.cluster.launcher as launcher
    from stages.errors import EldrError

    class StopAtStart:
        def __init__(self, spec: launcher.ClusterSpec) -> None:
            self.spec = spec
            self.specs: list[object] = []
            self.prefill_urls, self.decode_urls = ["http://127.0.0.1:1"], ["http://127.0.0.1:2"]
            self.decode_batch_endpoints = ["tcp://127.0.0.1:3"]

        expert_event_endpoints: list[str | None] = []  # noqa: RUF012

        def compute_groups(self, role: str) -> tuple[int, ...]:
            return ()

        def kv_event_endpoints(self, role: str) -> list[str | None]:
            return [None]

        def start(self, on_ready=None) -> None:  # type: ignore[no-untyped-def]
            raise EldrError("stopped before starting vLLM")

        def stop(self) -> None:
            pass

    monkeypatch.setattr(launcher, "Cluster", StopAtStart)
    monkeypatch.setenv("ELDR_HOME", str(tmp_path))
    monkeypatch.delenv("ELDR_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    port = str(free_port())
    argv = ["serve", "--policy", "rr", "--host", "0.0.0.0", "--port", port]
    exposed = runner.invoke(app, argv)
    assert isinstance(exposed.exception, EldrError)  # a user error, before anything started
    assert "has no API key" in str(exposed.exception) and "--insecure" in str(exposed.exception)
    insecure = runner.invoke(app, [*argv, "--insecure"])
    assert "no API key (--insecure)" in insecure.output
    assert "stopped before starting vLLM" in str(insecure.exception)  # it went on to start
    keyed = runner.invoke(app, argv, env={"ELDR_API_KEY": "secret-key"})
    assert "API key" not in keyed.output
    assert "stopped before starting vLLM" in str(keyed.exception)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "eldrr"], "unknown policy 'eldrr'"),
        (["--policy", "rr", "--policy-config", '{{"eldr": {{"tau": -1}}}}'],
         "--policy-config: policy 'eldr': tau must be a finite number >= 0"),
        (["--policy", "rr", "--policy-config", "{{tau: 1}}"], "--policy-config: the policy config"
         " is not JSON"),
        (["--policy", "rr", "--policy-config", '{{"eldr-b": {{}}}}'],
         "--policy-config: unknown policy 'eldr-b'"),
        (["--policy", "rr", "--policy-config", '{{"eldr-bl": {{"eps": 0.3}}}}'],
         "--policy-config: policy 'eldr-bl' has no option 'eps' (its options: epsilon, tau)"),
        (["--policy", "rr", "--policy-config", '{{"eldr-bl": {{"epsilon": "0.3"}}}}'],
         "--policy-config: policy 'eldr-bl': epsilon must be a number"),
        (["--policy", "rr", "--policy-config", '{{"rr": {{"tau": 0.1}}}}'],
         "--policy-config: policy 'rr' has no option 'tau' (its options: none)"),
        (["--policy", "rr", "--port", "{busy}"], "--port: port {busy} on 127.0.0.1 is not free"),
        (["--policy", "rr", "--worker-port", "{busy}"], "--worker-port: port {busy}"),
        (["--policy", "rr", "--nixl-port", "{busy}"], "--nixl-port: port {busy}"),
        (["--policy", "rr", "--port", "{worker}"], "is also a port of a started worker"),
        (["--policy", "rr", "--attach-prefill", "http://127.0.0.1:1", "--attach-decode",
          "http://127.0.0.1:2", "--nixl-port", "7000"], "--nixl-port configures workers"),
        (["--policy", "rr", "--host", "0.0.0.0"], "or pass --insecure"),
    ],
)
def test_serve_checks_every_option_before_any_worker_starts(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import socket

    import stages.serve.cluster.launcher as launcher
    from stages.errors import EldrError

    started = []

    def start(self: launcher.Cluster, on_ready: object = None) -> None:
        started.append(self)
        raise EldrError("a worker was started")

    monkeypatch.setattr(launcher.Cluster, "start", start)
    monkeypatch.setenv("ELDR_HOME", str(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        worker = free_port()
        values = {"busy": str(busy.getsockname()[1]), "worker": str(worker + 1)}
        argv = [a.format(**values) for a in args]
        if "--port" not in argv:
            argv += ["--port", str(free_port())]
        if "--worker-port" not in argv:
            argv += ["--worker-port", str(worker)]
        result = runner.invoke(app, ["serve", "--prefill", "1", "--decode", "1", *argv])
    assert isinstance(result.exception, EldrError), result.output
    assert message.format(**values) in str(result.exception)
    assert started == []


def test_another_engine_cost_pass_needs_a_first_one(tmp_path: Path) -> None:
    alone = run_eldr("bench", "--another-pass", home=tmp_path)
    assert alone.returncode == 2 and "add --engine-cost" in alone.stderr
    # Said before any proxy is asked: none runs at this address.
    first = run_eldr("bench", "--engine-cost", "--another-pass", "--url",
                     f"http://127.0.0.1:{free_port()}", home=tmp_path)
    assert first.returncode == 2
    assert "run `eldr bench --engine-cost` first" in first.stderr
    assert "Traceback" not in alone.stderr + first.stderr


# --- the serve self-check: every worker, started or attached, whatever the policy ---


class _Serving:
    """Fake workers for `eldr serve` (tiny's signature shape) and what reached the proxy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, names: list[str]) -> None:
        import stages.serve.proxy.group as group
        from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker

        self.behaviors = [FakeBehavior(n) for n in names]
        self.servers = [BackgroundServer(create_fake_worker(b), "critical").start()
                        for b in self.behaviors]
        self.urls = [s.url for s in self.servers]
        self.configs: list[object] = []
        monkeypatch.setattr(group, "serve_group",
                            lambda config, *args, **kw: self.configs.append(config))
        monkeypatch.setenv("ELDR_HOME", str(tmp_path))

    def checked(self) -> list[str]:
        from stages.serve.proxy.ops.self_check import PROBE_PROMPT

        return [b.name for b in self.behaviors
                if any(r.body.get("prompt") == PROBE_PROMPT for r in b.received)]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def serving(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    s = _Serving(monkeypatch, tmp_path, ["p0", "d0", "d1"])
    yield s
    s.stop()


def test_serve_self_checks_started_workers_for_eldr_union(
    serving: _Serving, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import stages.serve.cluster.launcher as launcher
    from stages.models import resolve_model

    class StartedFakes:
        def __init__(self, spec: launcher.ClusterSpec) -> None:
            self.spec = spec
            self.specs: list[object] = []
            self.servers: list[object] = []
            self.prefill_urls, self.decode_urls = serving.urls[:1], serving.urls[1:]
            self.decode_batch_endpoints = [None] * len(self.decode_urls)

        expert_event_endpoints: list[str | None] = []  # noqa: RUF012

        def compute_groups(self, role: str) -> tuple[int, ...]:
            return ()

        def kv_event_endpoints(self, role: str) -> list[str | None]:
            return [None] * len(self.prefill_urls if role == "prefill" else self.decode_urls)

        def start(self, on_ready=None) -> None:  # type: ignore[no-untyped-def]
            pass

        def stop(self) -> None:
            pass

    monkeypatch.setattr(launcher, "Cluster", StartedFakes)
    result = runner.invoke(app, ["serve", "--policy", "eldr-union", "--port", str(free_port())])
    assert result.exit_code == 0, result.output
    assert serving.checked() == ["p0", "d0", "d1"]
    (config,) = serving.configs
    # The proxy checks each worker again when it rejoins; these start verified.
    assert config.self_check == resolve_model("tiny").identity  # type: ignore[attr-defined]
    assert config.checked_at_start  # type: ignore[attr-defined]


def test_serve_self_checks_attached_workers_and_refuses_one_without_signatures(
    serving: _Serving,
) -> None:
    from stages.errors import EldrError

    attach = ["--attach-prefill", serving.urls[0], "--attach-decode", serving.urls[1],
              "--attach-decode", serving.urls[2]]
    ok = runner.invoke(app, ["serve", "--policy", "rr", "--port", str(free_port()), *attach])
    assert ok.exit_code == 0, ok.output
    assert serving.checked() == ["p0", "d0", "d1"]
    serving.behaviors[2].signature = lambda body: None  # plain vLLM, no eldr
    refused = runner.invoke(app, ["serve", "--policy", "rr", "--port", str(free_port()),
                                  *attach])
    assert isinstance(refused.exception, EldrError)
    assert f"worker {serving.urls[2]} returns no expert signature" in str(refused.exception)
    assert "--skip-self-check" in str(refused.exception)
    assert len(serving.configs) == 1  # the proxy never opened


def test_skip_self_check_is_for_load_balancers_only(serving: _Serving) -> None:
    from stages.errors import EldrError

    for behavior in serving.behaviors:
        behavior.signature = lambda body: None
    attach = ["--attach-prefill", serving.urls[0], "--attach-decode", serving.urls[1],
              "--skip-self-check", "--port", str(free_port())]
    refused = runner.invoke(app, ["serve", "--policy", "eldr-union", *attach])
    assert isinstance(refused.exception, EldrError)
    assert "policy 'eldr-union' reads expert signatures" in str(refused.exception)
    ok = runner.invoke(app, ["serve", "--policy", "jsq", *attach])
    assert ok.exit_code == 0, ok.output
    assert serving.checked() == []
    (config,) = serving.configs
    assert config.skip_self_check and config.self_check is None  # type: ignore[attr-defined]
