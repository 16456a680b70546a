"""The zarr signature dataset: round trip, resumability, refusal of foreign or damaged stores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from stages.errors import EldrError
from stages.signature.dataset import CaptureRecord, ModelIdentity, SignatureDataset

TINY = ModelIdentity("tiny", 4, 16, 2)


def _records(n: int, start: int = 0) -> list[CaptureRecord]:
    rng = np.random.default_rng(start)
    return [
        CaptureRecord(f"r{i}", "code", "0" * 64, 10, 5,
                      rng.integers(0, 5, (4, 16)), rng.integers(0, 5, (4, 16)))
        for i in range(start, start + n)
    ]


def test_round_trip_and_append(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    SignatureDataset.create_or_open(path, TINY, "0.32.0").append(_records(3))
    SignatureDataset.create_or_open(path, TINY, "0.32.0").append(_records(2, start=3))
    dataset = SignatureDataset.open(path)
    arrays = dataset.read()
    assert dataset.ids() == {f"r{i}" for i in range(5)}
    assert arrays.prefill_counts.shape == (5, 4, 16)
    np.testing.assert_array_equal(arrays.decode_counts[4], _records(2, start=3)[1].decode_counts)


def test_store_of_another_model_is_refused_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    SignatureDataset.create_or_open(path, TINY, "0.32.0").append(_records(2))
    other = ModelIdentity("mixtral", 32, 8, 2)
    with pytest.raises(EldrError, match="holds signatures of tiny"):
        SignatureDataset.create_or_open(path, other, "0.32.0")
    assert len(SignatureDataset.open(path)) == 2


def test_rows_past_the_commit_mark_are_trimmed(tmp_path: Path) -> None:
    """A run killed mid-append leaves rows beyond ``committed``; they never surface."""
    path = tmp_path / "s.zarr"
    dataset = SignatureDataset.create_or_open(path, TINY, "0.32.0")
    dataset.append(_records(2))
    group = zarr.open_group(str(path), mode="r+")
    group["prefill_counts"].resize((3, 4, 16))  # as if killed after one array grew
    dataset.close()
    reopened = SignatureDataset.create_or_open(path, TINY, "0.32.0")
    assert len(reopened) == 2
    assert zarr.open_group(str(path))["prefill_counts"].shape[0] == 2


def test_damaged_or_foreign_store_gives_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EldrError, match="run `eldr capture`"):
        SignatureDataset.open(tmp_path / "missing.zarr")
    zarr.open_group(str(tmp_path / "plain.zarr"), mode="w")
    with pytest.raises(EldrError, match="not an eldr signature dataset"):
        SignatureDataset.open(tmp_path / "plain.zarr")
    (tmp_path / "junk.zarr").mkdir()
    (tmp_path / "junk.zarr" / "zarr.json").write_text("{not json")
    with pytest.raises(EldrError):
        SignatureDataset.open(tmp_path / "junk.zarr")


def test_xarray_opens_the_store_through_consolidated_metadata(tmp_path: Path) -> None:
    import warnings

    xr = pytest.importorskip("xarray")
    path = tmp_path / "s.zarr"
    SignatureDataset.create_or_open(path, TINY, "0.32.0").append(_records(3))
    SignatureDataset.create_or_open(path, TINY, "0.32.0").append(_records(2, start=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "not consolidated" would be a RuntimeWarning
        ds = xr.open_zarr(path, consolidated=True)
    assert ds["prefill_counts"].shape == (5, 4, 16)
    assert ds["prefill_counts"].dims == ("request", "layer", "expert")


_HOLD_WRITABLE = """
import sys, time
from pathlib import Path
from stages.signature.dataset import SignatureDataset
dataset = SignatureDataset.open(Path(sys.argv[1]), writable=True)
print("open", flush=True)
time.sleep(600)
"""


def test_one_writer_per_dataset_the_second_is_refused_naming_the_first(tmp_path: Path) -> None:
    """Each writable open trims rows past the commit mark: a second writer would cut the
    first's append in half. Readers go on; the lock goes with its process, kill -9 included."""
    import subprocess
    import sys

    path = tmp_path / "s.zarr"
    SignatureDataset.create_or_open(path, TINY, "0.32.0").append(_records(2))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_WRITABLE, str(path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(EldrError, match=f"process {holder.pid}"):
            SignatureDataset.create_or_open(path, TINY, "0.32.0")
        with pytest.raises(EldrError, match="one writer"):
            SignatureDataset.open(path, writable=True)
        assert len(SignatureDataset.open(path).read()) == 2  # a reader is not held up
    finally:
        holder.kill()
        holder.wait()
    SignatureDataset.create_or_open(path, TINY, "0.32.0").append(_records(1, start=2))
    assert len(SignatureDataset.open(path)) == 3


def test_a_writer_that_closes_lets_the_next_one_in(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    first = SignatureDataset.create_or_open(path, TINY, "0.32.0")
    with pytest.raises(EldrError, match="one writer"):
        SignatureDataset.create_or_open(path, TINY, "0.32.0")
    first.close()
    SignatureDataset.create_or_open(path, TINY, "0.32.0").append(_records(1))
    assert len(SignatureDataset.open(path)) == 1
