"""Moving the recorder's small per-step tensors between host and device without a host sync.

On a GPU worker, vLLM's async scheduling prepares step t+1 on the host while step t still runs
on the device. One blocking copy in the recorder's per-step path (``.cpu()``, ``.item()``,
``torch.tensor(..., device=cuda)`` from pageable memory, a data-dependent shape such as
``nonzero``) makes the host wait for the forward and ends that overlap. So:

- host -> device: index lists go through pinned memory with ``non_blocking=True``; torch's
  pinned-memory cache keeps such a buffer from being reused until its copy has run;
- device -> host: results are copied into pinned buffers with ``non_blocking=True`` and an
  event is recorded; :meth:`PendingCopy.wait` reads them later, where the step's own outputs
  have already reached the host (the scheduler's ``update_connector_output``, or the worker's
  output thread when the report is pickled), so the wait costs nothing by then.

On CPU there is no device to wait for: both directions are plain tensors, read at once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch


def on_host(device: torch.device) -> bool:
    return device.type == "cpu"


def to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, copied without blocking the host."""
    host = torch.tensor(values, dtype=torch.int64)
    if on_host(device):
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class PendingCopy:
    """Device tensors on their way to the host; :meth:`wait` gives them as numpy arrays."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        self._host: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if on_host(tensor.device):
                self._host[name] = tensor
                continue
            pinned = tensor.device.type == "cuda"
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            host.copy_(tensor, non_blocking=True)
            self._host[name] = host
            if pinned:
                self._event = torch.cuda.Event()
        if self._event is not None:
            self._event.record()

    def wait(self) -> dict[str, np.ndarray]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        # Copied out, so no array keeps a pinned buffer from going back to torch's cache.
        return {name: tensor.numpy().copy() for name, tensor in self._host.items()}


class StepTimer:
    """How long a step's forward took: host time on CPU, device events on GPUs (read later,
    so timing never waits for the device)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._started = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def start(self) -> None:
        if self._cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._events = (begin, torch.cuda.Event(enable_timing=True))
        else:
            self._started = time.perf_counter()

    def stop(self) -> StepTime:
        if self._events is not None:
            begin, end = self._events
            self._events = None
            end.record()
            return StepTime(events=(begin, end))
        return StepTime(seconds=time.perf_counter() - self._started)


class StepTime:
    """A step's duration, known now (CPU) or once its end event has passed (GPU)."""

    def __init__(
        self, seconds: float = 0.0,
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
    ) -> None:
        self._seconds = seconds
        self._events = events

    def seconds(self) -> float:
        if self._events is not None:
            begin, end = self._events
            end.synchronize()
            self._seconds = begin.elapsed_time(end) / 1000.0
            self._events = None
        return self._seconds
