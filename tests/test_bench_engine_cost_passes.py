"""Engine-cost passes: a later pass sends other prompts, its drift against the first is
measured, and one fit spans them (fake engines with a known cost; the real one in
test_serve_real)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import orjson
import pytest

from stages.bench.cost.engine_cost import EngineCostConfig, measure_engine_cost
from stages.bench.cost.engine_cost_passes import (
    PASSES_FILE,
    ProbePass,
    check_same_deployment,
    drift,
    excluded_prompts,
    fit_passes,
    load_passes,
    save_passes,
)
from stages.errors import EldrError
from tests.test_bench_http import ENGINE, LAYERS, FakeEngine, serve


def _prompts(tmp_path: Path) -> Path:
    lines = [
        orjson.dumps({"id": f"{d}{i}", "prompt": f"{d} {' '.join(['w'] * (4 + 6 * i))}",
                      "domain": d}).decode()
        for d in ("alpha", "beta", "gamma") for i in range(10)
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _measure(engine: FakeEngine, prompts: Path, exclude: frozenset[str], seed: int) -> ProbePass:
    with serve(engine.app) as url:
        result = measure_engine_cost(EngineCostConfig(
            worker_urls=(url,), prompts_path=prompts, num_layers=LAYERS, batch_sizes=(1, 2, 4),
            domain_mixes=(1, 0), max_tokens=6, repeats=1, prefill_probes=4, settle_s=0.0,
            seed=seed, exclude_prompts=exclude,
        ))
    # Both fakes stand for one deployment: the passes name the same worker.
    return ProbePass.of(result, f"t{seed}", ("http://worker",), (1,))


def _renamed(p: ProbePass) -> ProbePass:
    ms = tuple(dataclasses.replace(m, worker_url="http://worker") for m in p.measurements)
    return dataclasses.replace(p, measurements=ms)


def test_a_later_pass_sends_other_prompts_and_measures_the_drift(tmp_path: Path) -> None:
    prompts = _prompts(tmp_path)
    first = _renamed(_measure(FakeEngine(), prompts, frozenset(), 0))
    slow_engine = dataclasses.replace(ENGINE, base_s=ENGINE.base_s * 1.3,
                                      per_token_s=ENGINE.per_token_s * 1.3,
                                      per_expert_s=ENGINE.per_expert_s * 1.3)
    slower = FakeEngine(slow_engine)
    second = _renamed(_measure(slower, prompts, excluded_prompts([first]), 1))

    sent_later = {text for text, _ in slower.served}
    assert first.prompt_ids and second.prompt_ids
    assert not set(first.prompt_ids) & set(second.prompt_ids)
    texts = {orjson.loads(line)["id"]: orjson.loads(line)["prompt"]
             for line in prompts.read_text().splitlines()}
    assert not sent_later & {texts[i] for i in first.prompt_ids}  # no prefix-cache hits

    # The fake's counted steps are exact (its prefill is wall-clock: not compared here).
    same = drift(first, first)
    assert same.step == pytest.approx(1.0) and not same.large
    moved = drift(first, second)
    assert moved.step == pytest.approx(1.3, rel=1e-3)
    assert moved.large and "+30.0%" in moved.describe()

    # One fit over both sits between the two engines: the first pass's steps below it, the
    # second's above.
    both = fit_passes([first, second])
    assert len(both.measurements) == len(first.measurements) + len(second.measurements)
    assert len(both.prefill_points) == len(first.prefill_points) + len(second.prefill_points)
    forward = dataclasses.replace(both.model, base_s=both.model.base_s - both.step_overhead_s)

    def against_joint(p: ProbePass) -> float:
        return float(np.median([m.sample.step_s / float(forward.step_time(m.sample.batch,
                                                                            m.sample.distinct))
                                for m in p.measurements]))

    assert against_joint(first) < 1.0 < against_joint(second)


def test_passes_round_trip_and_refuse_a_foreign_file(tmp_path: Path) -> None:
    prompts = _prompts(tmp_path)
    one = _renamed(_measure(FakeEngine(), prompts, frozenset(), 0))
    path = tmp_path / PASSES_FILE
    save_passes(path, [one])
    (loaded,) = load_passes(path)
    assert loaded == one
    assert not list(tmp_path.glob("*.tmp"))

    with pytest.raises(EldrError, match="eldr bench --engine-cost"):
        load_passes(tmp_path / "missing" / PASSES_FILE)
    path.write_text("{not json")
    with pytest.raises(EldrError, match="not an engine-cost passes file"):
        load_passes(path)
    path.write_bytes(orjson.dumps({"format": 99, "passes": []}))
    with pytest.raises(EldrError, match="format 99"):
        load_passes(path)
    path.write_bytes(orjson.dumps({"format": 1, "passes": [{"started": "x"}]}))
    with pytest.raises(EldrError, match="not an engine-cost passes file"):
        load_passes(path)

    check_same_deployment(one, ("http://worker",), LAYERS)
    with pytest.raises(EldrError, match="without --another-pass"):
        check_same_deployment(one, ("http://elsewhere",), LAYERS)
    with pytest.raises(EldrError, match="without --another-pass"):
        check_same_deployment(one, ("http://worker",), LAYERS + 1)


def test_a_pass_with_every_prompt_already_sent_says_so(tmp_path: Path) -> None:
    prompts = _prompts(tmp_path)
    every = frozenset(orjson.loads(line)["id"] for line in prompts.read_text().splitlines())
    with pytest.raises(EldrError, match="earlier pass"):
        measure_engine_cost(EngineCostConfig(
            worker_urls=("http://127.0.0.1:9",), prompts_path=prompts, num_layers=LAYERS,
            exclude_prompts=every,
        ))


def test_the_cli_adds_a_pass_prints_the_drift_and_refits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from typer.testing import CliRunner

    import stages.bench.live.live_run as live_run
    from eldr_cli.app import app
    from stages.routing.cost_model import CostModel

    monkeypatch.setattr(live_run, "artifact_num_layers", lambda: LAYERS)
    engine = FakeEngine()
    with serve(engine.app) as worker:
        async def state(request):  # type: ignore[no-untyped-def]
            return JSONResponse({"decode_workers": [{"index": 0, "url": worker}],
                                 "prefill_workers": []})

        proxy = Starlette(routes=[Route("/admin/state", state)])
        with serve(proxy) as url:
            argv = ["bench", "--engine-cost", "--url", url, "--prompts", str(_prompts(tmp_path)),
                    "--result-dir", str(tmp_path / "results")]
            first = CliRunner().invoke(app, argv)
            assert first.exit_code == 0, first.output
            second = CliRunner().invoke(app, [*argv, "--another-pass"])
            assert second.exit_code == 0, second.output
    assert "pass 2 against pass 1" in second.output and "fit over 2 passes" in second.output
    passes = load_passes(tmp_path / "results" / PASSES_FILE)
    assert len(passes) == 2 and not set(passes[0].prompt_ids) & set(passes[1].prompt_ids)
    saved = CostModel.load(tmp_path / "results" / "cost-model.json")
    assert saved == fit_passes(passes).model
