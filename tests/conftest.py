"""Shared fixtures. Real vLLM servers start once per module that needs them and are shared."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from stages.paths import BUNDLED_MODELS_DIR

if TYPE_CHECKING:
    from stages.engine import VllmServer
    from stages.signature.dataset import ModelIdentity, SignatureArrays, SignatureDataset

TINY = BUNDLED_MODELS_DIR / "tiny"

# Tests never reach a model hub, and vLLM servers started by tests log to the test's tmp dir.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def wait_ready(server: VllmServer, timeout_s: float) -> None:
    """Block until a started vLLM server is healthy; past ``timeout_s`` stop it and say why
    (eldr itself waits for many workers at once: stages.serve.cluster.launcher)."""
    from stages.engine import tail
    from stages.errors import EldrError

    deadline = time.monotonic() + timeout_s
    while not server.poll_ready():
        if time.monotonic() > deadline:
            server.stop()
            raise EldrError(f"vLLM server on port {server.spec.port} not ready after"
                            f" {timeout_s:.0f} s; see {server.log_path}:\n"
                            f"{tail(server.log_path)}")
        time.sleep(0.5)


def free_port() -> int:
    # Below the ephemeral range, where no other socket's automatic bind can take it before the
    # server under test binds it (stages.serve.cluster.ports).
    from stages.serve.cluster.ports import free_ports

    return free_ports(1)[0]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    if not (TINY / "config.json").exists():
        pytest.fail(f"bundled model missing at {TINY}")
    return TINY


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


requires_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


# The calibration capture every real-vLLM module that fits an artifact starts from: the
# bundled calibration file interleaves its seven domains, so its first 400 prompts hold them all
# (enough held-out requests for `eldr fit`'s gain at batches of 4 to 16 on two clusters), and 16
# decode tokens give each a decode profile.
CALIBRATION_LIMIT, CALIBRATION_TOKENS = 400, 16


@pytest.fixture(scope="session")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A signature dataset of the bundled calibration prompts, captured once per test run by
    `eldr capture` as a user runs it (tiny, compiled). Read it; copy it to change it."""
    from tests.proc_probe import eldr_ok

    home = tmp_path_factory.mktemp("calibration")
    eldr_ok("capture", "--limit", str(CALIBRATION_LIMIT), "--max-tokens",
            str(CALIBRATION_TOKENS), home=home, timeout=900)
    return home / "signatures.zarr"


def home_with(calibration: Path, home: Path) -> Path:
    """``home`` as an ELDR_HOME holding its own copy of the calibration dataset."""
    import shutil

    home.mkdir(parents=True, exist_ok=True)
    shutil.copytree(calibration, home / "signatures.zarr")
    return home


@pytest.fixture(scope="session")
def plain_reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Plain vLLM's greedy outputs for ``tests.plain_reference.PROMPTS``; its engine is gone
    once they are in (tests.plain_reference)."""
    from tests.plain_reference import plain_outputs

    return plain_outputs(tiny_model, free_port(), tmp_path_factory.mktemp("plain-reference"))


@pytest.fixture(scope="module")
def plain_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One vLLM server on the tiny model with eldr's connector (signatures, no PD). Eager: it
    starts faster, and compiled recording is checked by every capture and serve test."""
    from stages.engine import ServerSpec, VllmServer

    spec = ServerSpec(
        model=str(tiny_model), port=free_port(), role="plain", served_name="tiny",
        enforce_eager=True,
        extra_args=("--enable-prompt-tokens-details",),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    server = VllmServer(spec, tmp_path_factory.mktemp("vllm-logs"))
    try:
        wait_ready(server, timeout_s=240)
        yield server.url
    finally:
        server.stop()



def write_dataset(path: Path, arrays: SignatureArrays, identity: ModelIdentity,
                  rows: int | None = None) -> SignatureDataset:
    """A signature dataset at ``path`` holding the first ``rows`` (all) of ``arrays`` (e.g.
    synthetic ones), as `eldr capture` would have written them."""
    from stages.signature.dataset import CaptureRecord, SignatureDataset

    dataset = SignatureDataset.create_or_open(path, identity, "test")
    dataset.append([
        CaptureRecord(id=str(arrays.ids[i]), domain="d", prompt_sha256="",
                      prompt_tokens=int(arrays.prompt_tokens[i]),
                      output_tokens=int(arrays.output_tokens[i]),
                      prefill_counts=arrays.prefill_counts[i],
                      decode_counts=arrays.decode_counts[i])
        for i in range(len(arrays) if rows is None else rows)
    ])
    return dataset


def without_probe(traced: np.ndarray, model_dir: Path) -> np.ndarray:
    """A capture's traced picks ``[L, tokens, k]`` less the self-check probe's prompt, which
    `eldr capture` runs on its engine before recording (``check_engine_records``)."""
    from transformers import AutoTokenizer

    from stages.serve.proxy.ops.self_check import PROBE_PROMPT

    probe = len(AutoTokenizer.from_pretrained(model_dir)(PROBE_PROMPT)["input_ids"])
    return traced[:, probe:]
