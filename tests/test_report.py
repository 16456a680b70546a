"""`eldr report`: one self-contained page from results folders and artifacts written by the
real writers (`eldr fit`, `eldr bench --simulate`, the live bench's save_comparison and
write_plots), with no vLLM."""

from __future__ import annotations

import base64
import html
import re
import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import orjson
import pytest
from typer.testing import CliRunner

from eldr_cli.app import app, main
from stages.bench.metrics import RequestRecord, RequestTable
from stages.bench.plots import write_plots
from stages.bench.report import BASELINES
from stages.bench.results import ComparisonResult, PolicyResult, save_comparison
from stages.fit.artifact import ArtifactStore
from stages.fit.gain_report import verdict_line
from stages.provenance import command_line
from stages.report.inputs import gather
from stages.report.page import render
from stages.signature.dataset import ModelIdentity
from stages.signature.transform import SignatureTransform
from stages.vllm_compat import installed_vllm

runner = CliRunner()
SIM_ARGS = ["bench", "--simulate", "--policies", "eldr,eldr-union,jsq,rr", "--prefill", "1",
            "--decode", "2", "--duration", "3", "--cost", "cpu", "--request-rate", "5,8"]
DIAL_ARGS = ["bench", "--simulate", "--policies", "eldr,eldr-union,jsq", "--prefill", "1",
             "--decode", "2", "--duration", "2", "--cost", "cpu", "--request-rate", "5",
             "--locality-blend", "0,1"]
LIVE_ARGS = ["bench", "--url", "http://127.0.0.1:8000", "--policies", "eldr-union,jsq"]


@dataclass(frozen=True)
class Home:
    root: Path  # $ELDR_HOME: results/ (live), results/sim, results/dial, artifacts/
    live: Path
    sim: Path
    dial: Path
    store: Path


def _invoke(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    """Run an eldr command in process, with sys.argv as the `eldr` script would see it (the
    results record it)."""
    monkeypatch.setattr(sys, "argv", ["/venv/bin/eldr", *args])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output


def _live_results(folder: Path) -> None:
    """A live bench's files and plots, through the bench's own writers."""
    results = {}
    for n, name in enumerate(("eldr-union", "jsq")):
        records = [
            RequestRecord(request_id=f"{name}-{i}", success=True, prompt_tokens=30,
                          output_tokens=12, ttft_s=0.2 + 0.01 * i,
                          latency_s=1.3 + 0.1 * n + 0.02 * i, itl_s=(0.1 + 0.01 * n,) * 11,
                          start_s=0.1 * i, prompt_id=str(i))
            for i in range(8)
        ]
        metrics = {"median_tpot_ms": 100.0 + 7 * n, "p99_tpot_ms": 123.456 + n,
                   "median_ttft_ms": 200.0, "distinct_experts_per_layer": 4.25 + n,
                   "completed": 8, "failed": 0}
        results[name] = PolicyResult(name, metrics, RequestTable.from_records(records),
                                     tuple(records))
    state = {"prefill_workers": [{"index": 0}], "decode_workers": [{"index": 0}, {"index": 1}],
             "artifact_version": "abcdef012345"}
    info = {"url": "http://127.0.0.1:8000", "model_id": "tiny-wide", "max_tokens": 12,
            "rounds": 2, "policy_order": ["eldr-union", "jsq"],
            "proxy_state": {"eldr-union": state, "jsq": state}}
    comparison = ComparisonResult(3.0, results, info)
    save_comparison(comparison, folder)
    write_plots([comparison], folder, "1P2D live, http://127.0.0.1:8000")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Home:
    from stages.bench.sim.synthetic import SyntheticSpec, synthetic_signatures
    from tests.conftest import write_dataset

    root = tmp_path_factory.mktemp("home")
    spec = SyntheticSpec(num_requests=240, num_layers=4, num_experts=16, top_k=2,
                         domain_experts=6, min_output=8, max_output=16)
    identity = ModelIdentity(name="syn", num_layers=4, num_experts=16, top_k=2)
    write_dataset(root / "signatures.zarr", synthetic_signatures(spec), identity)
    h = Home(root, root / "results", root / "results" / "sim", root / "results" / "dial",
             root / "artifacts")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ELDR_HOME", str(root))
        _invoke(mp, ["fit", "--k", "2", "--decode-batch", "4"])
        _invoke(mp, [*SIM_ARGS, "--result-dir", str(h.sim)])
        _invoke(mp, [*DIAL_ARGS, "--result-dir", str(h.dial)])
        mp.setattr(sys, "argv", ["/venv/bin/eldr", *LIVE_ARGS])
        _live_results(h.live)
    return h


def _rows(page: str, heading: str) -> dict[str, list[str]]:
    """policy -> its cells in the table under ``heading`` (the next <table> after the kv one)."""
    start = page.index(heading)
    tables = re.findall(r"<table>(.*?)</table>", page[start:], flags=re.S)
    body = tables[0]
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", body.split("<tbody>")[1], flags=re.S):
        cells = [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row, flags=re.S)]
        rows[cells[0]] = cells[1:]
    return rows


def _fmt(value: float) -> str:
    """The bench table's rule for a float figure (stages.bench.report)."""
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}"


def _check_table(page: str, heading: str, folder: Path, rate: str) -> None:
    """Every policy's TPOT, experts and /best cells are its file's figures."""
    docs = {p.name.rsplit("-", 1)[0]: orjson.loads(p.read_bytes())
            for p in folder.glob(f"*-{rate}qps.json")}
    rows = _rows(page, heading)
    assert set(rows) == set(docs)
    # Columns: 12 figures (TPOT p50 3rd, TPOT p99 4th, experts/L 12th), then the two ratios.
    for key, col in (("median_tpot_ms", 2), ("p99_tpot_ms", 3),
                     ("distinct_experts_per_layer", 11)):
        for name, doc in docs.items():
            assert rows[name][col] == _fmt(doc[key]), (name, key)
    for key, col in (("median_tpot_ms", 12), ("p99_tpot_ms", 13)):
        best = min(d[key] for n, d in docs.items() if n in BASELINES)
        for name, doc in docs.items():
            assert rows[name][col] == f"{doc[key] / best:.2f}", (name, key)


def _embedded(page: str, png: Path) -> bool:
    return f"data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}" in page


def test_the_page_holds_verdict_tables_plots_versions_and_commands(home: Home) -> None:
    page = render(gather([home.live, home.sim, home.dial, home.store]))
    artifact = ArtifactStore(home.store).load()
    verdict = verdict_line(artifact.metrics["expected_gain"])
    assert f'<p class="verdict">{html.escape(verdict)}</p>' in page
    # Live and simulated tables, each at its rate, with the figures of their files.
    _check_table(page, "<h4>live, 3 req/s", home.live, "3")
    _check_table(page, "<h4>simulated, 5 req/s", home.sim, "5")
    _check_table(page, "<h4>simulated, 8 req/s", home.sim, "8")
    assert "<th>workers</th><td>1P2D</td>" in page and "<td>tiny-wide</td>" in page
    # The dial: the sweep's cells from its file; the artifact has no dial entry.
    dial_doc = orjson.loads(next(home.dial.glob("sim-locality-dial-*.json")).read_bytes())
    ratios = dial_doc["policies"]["eldr-union"]
    dial_rows = _rows(page, "<h2>Locality dial</h2>")
    assert dial_rows["eldr-union"][0] == (f"{ratios['median_tpot_ms_over_best_balancer'][0]:.2f}"
                                          f" / {ratios['p99_tpot_ms_over_best_balancer'][0]:.2f}")
    mark = dial_doc["data_mark"]  # the fit's held-out gain placed on the dial
    assert f"your data: s = {_fmt(mark['strength'])} ({html.escape(mark['source'])})" in page
    # The artifact's own dial entry, where this eldr's fit computes one.
    dial_section = page[page.index("<h2>Locality dial</h2>"):page.index("<h2>Live results")]
    assert ("<p>not computed</p>" in dial_section) == ("dial" not in artifact.metrics)
    # Every plot of every folder, and the fit's, inlined.
    pngs = [*home.live.glob("*.png"), *home.sim.glob("*.png"), *home.dial.glob("*.png"),
            home.store / artifact.version / "fit.png"]
    assert len(pngs) >= 5 and all(_embedded(page, p) for p in pngs)
    # Versions and the command of each input, as the writers recorded them: one row per
    # table and dial, and the artifact's (`eldr fit` stores them in its params).
    stamps: dict[str, list[str]] = {}
    body = page[page.index("<h2>Versions and commands</h2>"):]
    for row in re.findall(r"<tr>(.*?)</tr>", body.split("<tbody>")[1], flags=re.S):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", c))
                 for c in re.findall(r"<td>(.*?)</td>", row, flags=re.S)]
        stamps[cells[1]] = cells[2:]
    sim, dial = ([*a, "--result-dir", str(d)] for a, d in ((SIM_ARGS, home.sim),
                                                            (DIAL_ARGS, home.dial)))
    commands = {"live 3 req/s": LIVE_ARGS, "simulated 5 req/s": sim,
                "simulated 8 req/s": sim, "locality dial 5 req/s": dial,
                f"artifact {artifact.version}": ["fit", "--k", "2", "--decode-batch", "4"]}
    for what, args in commands.items():
        eldr, vllm, command = stamps[what]
        assert eldr.startswith(version("eldr"))
        assert vllm == (installed_vllm() or "not installed")
        assert command == command_line(["eldr", *args])
    # Self-contained: nothing to fetch, nothing to run.
    assert "<script" not in page and "<link" not in page and 'src="http' not in page


def test_input_text_is_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = '<img src=x onerror="alert(1)">&'
    table = RequestTable.from_records([RequestRecord("r", True, 3, 4, 0.1, 0.4, (0.1,) * 3)])
    metrics = {"median_tpot_ms": 1.0, "completed": 1, "failed": 0}
    monkeypatch.setattr(sys, "argv", ["eldr", "bench", "--policies", "<b>bold</b>"])
    save_comparison(ComparisonResult(2.0, {name: PolicyResult(name, metrics, table)}),
                    tmp_path)
    page = render(gather([tmp_path]))
    assert name not in page and "<b>bold</b>" not in page
    assert html.escape(name) in page
    assert html.escape("eldr bench --policies '<b>bold</b>'") in page


def _save_artifact(store: ArtifactStore, metrics: dict[str, object]) -> str:
    """A small artifact through the real store (its centroids do not matter here)."""
    identity = ModelIdentity(name="syn", num_layers=2, num_experts=4, top_k=1)
    transform = SignatureTransform(idf=np.ones((2, 4), np.float32),
                                   layer_mask=np.array([True, True]))
    return store.save(centroids=np.eye(2, 8, dtype=np.float32), transform=transform,
                      identity=identity, dataset_hash="ab" * 32, params={"k": 2},
                      metrics=metrics)


def _dial_section(page: str) -> str:
    return page[page.index("<h2>Locality dial</h2>"):page.index("<h2>Live results")]


def test_an_artifact_dial_entry_is_shown_or_said_not_computed(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    with_dial = _save_artifact(store, {"dial": {"strength": 0.375, "batch_size": 8}})
    # A version folder reads as its artifact, as the store does.
    page = render(gather([store.root / with_dial]))
    assert "not computed" not in _dial_section(page)
    assert "<th>strength</th><td><code>0.375</code></td>" in _dial_section(page)
    # No gain estimate in this artifact: no verdict, said so.
    assert '<p class="verdict">not computed: this artifact predates the gain estimate' in page
    without = _save_artifact(store, {"holdout": {}})
    page = render(gather([store.root / without]))
    assert f"<h3>artifact {without}</h3>\n<p>not computed</p>" in _dial_section(page)


def test_no_paths_reads_the_default_places(home: Home, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELDR_HOME", str(home.root))
    out = tmp_path / "shared" / "report.html"
    monkeypatch.setattr(sys, "argv", ["eldr", "report", "--out", str(out)])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0
    page = out.read_text()
    for folder in (home.live, home.sim, home.dial):
        assert f"results folder <code>{html.escape(str(folder))}</code>" in page
    assert f"artifact <code>{ArtifactStore(home.store).latest_version()}</code>" in page
    assert "eldr report --out" in page  # the page's own command


def _fails(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
           *args: str) -> str:
    monkeypatch.setattr(sys, "argv", ["eldr", "report", *args])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_bad_inputs_are_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "r.html")
    (tmp_path / "empty").mkdir()
    assert "holds no eldr results" in _fails(monkeypatch, capsys, str(tmp_path / "empty"),
                                             "-o", out)
    (tmp_path / "file.json").write_text("{}")
    assert "is not a folder" in _fails(monkeypatch, capsys, str(tmp_path / "file.json"))
    assert "does not exist" in _fails(monkeypatch, capsys, str(tmp_path / "nowhere"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "jsq-2qps.json").write_text("{not json")
    assert "not a readable JSON result file" in _fails(monkeypatch, capsys,
                                                       str(tmp_path / "bad"))
    monkeypatch.setenv("ELDR_HOME", str(tmp_path / "home"))
    assert "nothing to report" in _fails(monkeypatch, capsys, "-o", out)
    assert not Path(out).exists()


def test_the_command_line_is_recorded_as_typed() -> None:
    assert command_line(["/x/.venv/bin/eldr", "bench", "--policies", "a b"]) == (
        "eldr bench --policies 'a b'")
    assert command_line(["/x/eldr_cli/__main__.py", "fit"]) == "eldr fit"


def test_the_fit_s_own_dial_sentence_heads_its_entry(tmp_path: Path) -> None:
    dial = pytest.importorskip("stages.fit.dial")  # the fit stage's dial, where it has one
    entry = {"skipped": "the dial's dataset holds <10 requests"}
    _save_artifact(ArtifactStore(tmp_path), {"dial": entry})
    page = render(gather([tmp_path]))
    assert f'<p class="verdict">{html.escape(dial.dial_line(entry))}</p>' in _dial_section(page)
