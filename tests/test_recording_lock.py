"""`eldr serve --record` and `eldr capture` on one dataset: one writer at a time. The recorder
holds the dataset's writer lock for as long as it records (its writer process appends under
it); a second recorder, or a capture, is refused at its start, naming the first."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from stages.errors import EldrError
from stages.serve.proxy.recording.row import RecordedRow, build_record, identity_of
from stages.signature import wire
from stages.signature.appender import DatasetAppender
from stages.signature.dataset import ModelIdentity, SignatureDataset

IDENTITY = ModelIdentity("m", 2, 4, 2)


def _appender(path: Path) -> DatasetAppender:
    return DatasetAppender(path, "v", build_record, partial(identity_of, "m", IDENTITY))


def _row(name: str) -> RecordedRow:
    counts = wire.encode(np.ones((2, 4), dtype=np.int32))
    return RecordedRow(name, counts, counts, b"p", False, 8, 4, 0.0, 0.1, 0.2)


def test_a_recording_holds_the_dataset_against_a_second_writer(tmp_path: Path) -> None:
    import os

    path = tmp_path / "t.zarr"
    recording = _appender(path)  # a new dataset: locked before its first row
    try:
        with pytest.raises(EldrError, match=f"process {os.getpid()}.*one writer"):
            _appender(path)
        with pytest.raises(EldrError, match="one writer"):
            SignatureDataset.create_or_open(path, IDENTITY, "v")
        assert recording.put([_row("r0"), _row("r1")])  # its own writer process appends
        deadline = time.monotonic() + 120  # the writer runs at a low priority (nice 10)
        while recording.counts.appended < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert recording.counts.appended == 2, recording.counts
        assert len(SignatureDataset.open(path)) == 2  # readers go on
    finally:
        recording.close()
    again = _appender(path)  # closed: the next recording starts
    again.close()


def test_a_recording_is_refused_while_a_capture_writes(tmp_path: Path) -> None:
    path = tmp_path / "t.zarr"
    capture = SignatureDataset.create_or_open(path, IDENTITY, "v")
    with pytest.raises(EldrError, match="one writer"):
        _appender(path)
    capture.close()
    _appender(path).close()


def test_a_dataset_path_that_cannot_be_written_is_refused_at_the_start(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(EldrError, match="cannot write a signature dataset"):
        _appender(tmp_path / "file" / "t.zarr")
