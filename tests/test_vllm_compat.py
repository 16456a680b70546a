"""The vLLM gate: releases eldr's real tests ran on run silently, others run with a warning once
their sources pass the static check of every touchpoint, and one missing a touchpoint is
refused by name. The static check reads sources (installed, a directory or a wheel), never
imports them."""

from __future__ import annotations

import inspect
import os
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from stages import vllm_compat, vllm_static_check, vllm_touchpoints
from stages.errors import EldrError
from stages.vllm_static_check import Checker, Sources, failures
from stages.vllm_touchpoints import CONNECTOR_OVERRIDES, Check, Touchpoint
from tests.conftest import requires_vllm

ROUTER = "vllm/model_executor/layers/fused_moe/router/base_router.py"
CONNECTOR_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


@pytest.mark.parametrize(
    ("release", "run"),
    [("0.32.0", True), ("0.31.0", True), ("0.32.1+cpu", True), ("0.33.0", False),
     ("0.30.2", False), ("1.0.0", False)],
)
def test_releases_the_real_tests_ran_on(release: str, run: bool) -> None:
    assert vllm_compat.was_run(release) is run


def test_the_gate_can_be_told_a_release_was_never_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_compat.NEVER_RUN_ENV, "0.31, 0.32")
    assert not vllm_compat.was_run("0.32.0")
    assert not vllm_compat.was_run("0.31.2")


def test_no_vllm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: None)
    with pytest.raises(EldrError, match="not installed"):
        vllm_compat.check_vllm()


@requires_vllm
def test_a_release_that_was_run_passes_silently() -> None:
    gate = vllm_compat.gate()
    assert gate.release == vllm_compat.installed_vllm()
    # Silent exactly where the real tests ran (scripts/gpu-check.sh installs the newest vLLM).
    assert (gate.warning is None) is vllm_compat.was_run(gate.release)


@requires_vllm
def test_a_release_never_run_passes_with_a_warning_naming_what_was_not_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    release = vllm_compat.installed_vllm()
    assert release is not None
    monkeypatch.setenv(vllm_compat.NEVER_RUN_ENV, vllm_compat.minor(release))
    gate = vllm_compat.gate()
    assert gate.warning is not None
    assert f"vLLM {release}: eldr's real-vLLM tests (capture, serve, architectures) were" \
           " not run" in gate.warning
    assert "static check" in gate.warning and "self-check" in gate.warning
    assert f"(run on {', '.join(vllm_compat.run_minors()) or 'none'})" in gate.warning
    assert vllm_compat.minor(release) not in vllm_compat.run_minors()
    assert vllm_compat.check_vllm() == release
    assert gate.warning in caplog.text


@requires_vllm
def test_a_release_missing_a_touchpoint_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    release = vllm_compat.installed_vllm()
    assert release is not None
    monkeypatch.setenv(vllm_compat.NEVER_RUN_ENV, vllm_compat.minor(release))
    gone = Touchpoint("vllm.config:VllmConfig.eldr_gone", Check.SIGNATURE, "a test")
    monkeypatch.setattr(vllm_touchpoints, "TOUCHPOINTS", (*vllm_touchpoints.TOUCHPOINTS, gone))
    with pytest.raises(EldrError, match=r"lacks what eldr's plugin relies on: "
                       r"vllm.config:VllmConfig.eldr_gone \[signature\]: "
                       r"VllmConfig.eldr_gone is missing"):
        vllm_compat.gate()


@requires_vllm
def test_the_installed_release_passes_the_static_check() -> None:
    results = Checker(Sources.installed()).run()
    assert failures(results) == [], [vllm_static_check.describe(r) for r in failures(results)]
    assert vllm_static_check.main(["--installed"]) == 0


def _doctored_copy(root: Path) -> Path:
    """The installed release's sources with KVConnectorBase_V1.request_finished renamed."""
    installed = Sources.installed()
    source = Path(installed.label)
    target = root / "site"

    def python_only(directory: str, names: list[str]) -> list[str]:
        return [n for n in names if not n.endswith(".py") and not (Path(directory) / n).is_dir()]

    import shutil

    shutil.copytree(source / "vllm", target / "vllm", ignore=python_only)
    base = target / CONNECTOR_BASE
    text = base.read_text()
    assert text.count("def request_finished(") == 1
    base.write_text(text.replace("def request_finished(", "def request_done("))
    return target


@requires_vllm
def test_a_doctored_copy_fails_naming_the_touchpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site = _doctored_copy(tmp_path)
    assert vllm_static_check.main(["--source", str(site)]) == 1
    out = capsys.readouterr().out
    assert "MISSING  vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1." \
           "request_finished [signature]: KVConnectorBase_V1.request_finished is missing" in out
    assert "1 missing" in out


@requires_vllm
def test_a_wheel_is_read_as_an_archive(tmp_path: Path) -> None:
    """The files the check reads, zipped as a wheel lays them out: the same verdict."""
    installed = Sources.installed()
    root = Path(installed.label)
    read: list[str] = []

    def recording(relative: str) -> str | None:
        path = root / relative
        if path.is_file():
            read.append(relative)
            return path.read_text(encoding="utf-8")
        return None

    assert failures(Checker(Sources(recording, "recorded")).run()) == []
    cache = tmp_path / "home" / ".cache" / "eldr" / "vllm-wheels"
    cache.mkdir(parents=True)
    wheel = cache / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for relative in set(read):
            archive.write(root / relative, relative)
    assert failures(Checker(Sources.from_wheel(wheel)).run()) == []
    # The script's --static mode reads the cached wheel (nothing downloaded).
    script = Path(__file__).resolve().parents[1] / "scripts" / "vllm-compat-check.sh"
    done = subprocess.run(["bash", str(script), "9.9.9", "--static"], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stderr
    summary = done.stdout.splitlines()[-1]
    assert summary.startswith(f"{wheel.name}: ") and " 0 missing" in summary, done.stdout
    doctored = tmp_path / "doctored.whl"
    with zipfile.ZipFile(wheel) as good, zipfile.ZipFile(doctored, "w") as bad:
        for name in good.namelist():
            text = good.read(name).decode()
            if name == ROUTER:
                text = text.replace("self.capture_fn(topk_ids)", "pass").replace(
                    "if self.capture_fn is not None:", "if True:")
            bad.writestr(name, text)
    missing = failures(Checker(Sources.from_wheel(doctored)).run())
    assert [r.touchpoint.target for r in missing] == [
        "vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter._select_experts"
    ]
    assert "no longer refers to self.capture_fn" in missing[0].detail


def test_a_cached_wheel_is_not_downloaded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("downloaded again")

    monkeypatch.setattr(vllm_static_check.subprocess, "run", no_download)
    assert vllm_static_check.cached_wheel("0.33.0", tmp_path) == wheel


def test_an_unreadable_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EldrError, match="holds no vllm package"):
        Sources.from_directory(tmp_path)
    bad = tmp_path / "vllm-0.0.0.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(EldrError, match="cannot read the wheel"):
        Sources.from_wheel(bad)


@requires_vllm
def test_the_connector_overrides_listed_are_eldrs_own() -> None:
    """The touchpoint list names every KVConnectorBase_V1 method eldr's connector defines, with
    the parameters eldr's own definition takes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from stages.capture.connector import EldrSignatureConnector

    own = {
        name for name, value in vars(EldrSignatureConnector).items()
        if callable(getattr(value, "__func__", value)) and hasattr(KVConnectorBase_V1, name)
    }
    assert own == set(CONNECTOR_OVERRIDES)
    for name, expected in CONNECTOR_OVERRIDES.items():
        method = getattr(EldrSignatureConnector, name)
        params = [
            ("**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else "")
            + p.name for p in inspect.signature(method).parameters.values()
            if p.name not in ("self", "cls")
        ]
        assert tuple(params) == expected, name


def test_a_layer_with_substituted_experts_records_its_logical_experts() -> None:
    """vLLM 0.33's expert substitution (MoNE-pruned checkpoints): the router counts retained
    experts only but picks logical ids, so the table must be as wide as the logical count."""
    import torch

    from stages.capture.recorder import SignatureRecorder
    from stages.capture.topk_sink import BUFFER_NAME

    router = SimpleNamespace(global_num_experts=6)
    plain = SimpleNamespace(router=router, routed_experts=SimpleNamespace())
    assert vllm_compat.logical_num_experts(plain) == 6
    substitution = SimpleNamespace(num_logical_experts=8)
    pruned = SimpleNamespace(router=router,
                             routed_experts=SimpleNamespace(expert_substitution=substitution),
                             **{BUFFER_NAME: torch.zeros((4, 2), dtype=torch.int32)})
    recorder = SignatureRecorder(num_blocks=2, block_size=4, max_tokens=4)
    recorder.bind_layers([(0, pruned)], torch.device("cpu"))  # type: ignore[list-item]
    assert recorder.num_experts == 8
    assert recorder.table is not None and recorder.table.shape == (3, 1, 8)
