"""Property-based tests of eldr's formats: whatever bytes arrive, the signature wire format,
the zarr dataset and the artifact reader answer with a value or eldr's clear error, never
another exception (a traceback for the user, a 500 from the proxy) and never a hang."""

from __future__ import annotations

import base64
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stages.errors import EldrError
from stages.signature import wire

# Derandomized: CI runs the same examples every time (a new failure is a new bug, not luck), and
# a loaded machine must not fail the slow-generation check. The dataset and artifact tests
# rewrite files on disk: a few dozen examples each keeps the module within seconds.
WIRE = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
FILES = settings(WIRE, max_examples=40,
                 suppress_health_check=[HealthCheck.too_slow,
                                        HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=10,
)


@WIRE
@given(st.dictionaries(st.sampled_from([wire.SIGNATURE_KEY, wire.SHAPE_KEY,
                                        wire.MOE_LAYERS_KEY, "other"]), json_values))
def test_any_kv_transfer_params_decode_to_a_valid_table_or_none(params: dict) -> None:
    counts = wire.decode(params)
    if counts is not None:
        assert counts.ndim == 2 and (counts >= 0).all()
    wire.decode_moe_layers(params)


@WIRE
@example(b"\x01\x00", [-1, -1])  # found by hand: two negative sizes whose product fits
@given(st.binary(max_size=64), st.lists(st.integers(-4, 40), min_size=0, max_size=3))
def test_any_bytes_and_shape_decode_to_a_valid_table_or_none(raw: bytes, shape: list) -> None:
    params = {wire.SIGNATURE_KEY: base64.b64encode(raw).decode(), wire.SHAPE_KEY: shape}
    counts = wire.decode(params)
    if counts is not None:
        assert list(counts.shape) == shape and (counts >= 0).all()


@WIRE
@given(st.integers(1, 6), st.integers(1, 16), st.data())
def test_signatures_survive_the_wire(layers: int, experts: int, data: st.DataObject) -> None:
    counts = np.array(data.draw(st.lists(st.integers(0, 70000), min_size=layers * experts,
                                         max_size=layers * experts))).reshape(layers, experts)
    back = wire.decode(wire.encode(counts), expected_shape=(layers, experts))
    assert back is not None
    np.testing.assert_array_equal(back, np.minimum(counts, wire.MAX_COUNT))


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small real dataset and artifact, as capture and fit write them."""
    from stages.fit.artifact import ArtifactStore
    from stages.fit.pipeline import FitConfig, fit_artifact
    from stages.signature.dataset import CaptureRecord, ModelIdentity, SignatureDataset

    root = tmp_path_factory.mktemp("formats")
    identity = ModelIdentity("tiny", 2, 8, 2)
    rng = np.random.default_rng(0)
    # Two domains, each using its own half of the experts, before and during decode.
    half = np.zeros((40, 2, 8), np.int32)
    for i in range(40):
        half[i, :, (i % 2) * 4:(i % 2) * 4 + 4] = 6
    prefill = half + rng.integers(0, 2, size=(40, 2, 8)).astype(np.int32)
    decode = half + rng.integers(0, 2, size=(40, 2, 8)).astype(np.int32)
    dataset = SignatureDataset.create_or_open(root / "sig.zarr", identity, "0.32.0")
    dataset.append([CaptureRecord(str(i), "d", "0" * 64, 10, 4, prefill[i], decode[i])
                    for i in range(40)])
    fit_artifact(prefill, decode, identity, dataset.content_hash(), FitConfig(k=2),
                 ArtifactStore(root / "artifacts"))
    return root / "sig.zarr", root / "artifacts"


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _damage(root: Path, data: st.DataObject) -> None:
    victim = data.draw(st.sampled_from(_files(root)), label="file")
    content = victim.read_bytes()
    how = data.draw(st.sampled_from(["truncate", "garbage", "flip", "empty"]), label="how")
    if how == "truncate":
        victim.write_bytes(content[: data.draw(st.integers(0, max(0, len(content) - 1)))])
    elif how == "garbage":
        victim.write_bytes(data.draw(st.binary(max_size=200)))
    elif how == "flip" and content:
        at = data.draw(st.integers(0, len(content) - 1))
        victim.write_bytes(content[:at] + bytes([content[at] ^ 0xFF]) + content[at + 1:])
    else:
        victim.write_bytes(b"")


def _read_dataset(path: Path) -> None:
    from stages.signature.dataset import SignatureDataset

    arrays = SignatureDataset.open(path).read()
    assert arrays.prefill_counts.ndim == 3 and len(arrays) <= 40


def _load_artifact(path: Path) -> None:
    from stages.fit.artifact import ArtifactStore

    artifact = ArtifactStore(path).load()
    assert np.isfinite(artifact.centroids).all() and artifact.centroids.shape[0] == 2


@pytest.mark.parametrize(("which", "read"), [(0, _read_dataset), (1, _load_artifact)],
                         ids=["dataset", "artifact"])
@FILES
@given(data=st.data())
def test_a_damaged_store_is_read_or_refused_clearly(
    stored: tuple[Path, Path], tmp_path: Path, which: int, read: Callable[[Path], None],
    data: st.DataObject,
) -> None:
    """A file of the dataset or of the artifact store truncated, replaced, flipped or
    emptied: it reads as something valid, or raises eldr's clear error."""
    copy = Path(tempfile.mkdtemp(dir=tmp_path)) / stored[which].name
    shutil.copytree(stored[which], copy)
    _damage(copy, data)
    try:
        read(copy)
    except EldrError:
        return
