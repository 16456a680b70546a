"""The recorder as it runs on a GPU worker, without a GPU: no host sync in its per-step path,
unwritten ids never counted, pipeline stages' reports merged by layer, refused layouts.

The no-sync check runs the recorder with its table and buffers on PyTorch's ``meta`` device
(shapes without data) under a dispatch mode that stands for the GPU's rules: any read of a
device value by the host (``.item()``, ``bool(tensor)``, a blocking copy either way, an op
whose output shape depends on the data) fails, and a non-blocking copy to or from the host is
let through, as the GPU would run it asynchronously.
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stages.capture import recorder as recorder_module
from stages.capture.messages import StepPlan, StepReport
from stages.capture.parallel import ParallelLayout, check_layout
from stages.capture.topk_sink import attach
from tests.test_capture_parts import FakeMoELayer, end

aten = torch.ops.aten
META = torch.device("meta")
HOST_READS = {
    aten._local_scalar_dense.default: ".item() / bool() of a device tensor",
    aten.nonzero.default: "nonzero (data-dependent shape)",
    aten.masked_select.default: "masked_select (data-dependent shape)",
    aten.unique_consecutive.default: "unique (data-dependent shape)",
    aten._unique2.default: "unique (data-dependent shape)",
}


class HostSync(AssertionError):
    pass


class FailsOnHostSync(TorchDispatchMode):
    """The GPU's rules, on meta tensors: a host read or blocking copy fails the test."""

    def __init__(self) -> None:
        super().__init__()
        self.async_copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise HostSync(f"{HOST_READS[func]} in the per-step path ({func})")
        if func is aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        ):
            raise HostSync("boolean-mask indexing (data-dependent shape)")
        if func is aten._to_copy.default:
            target = kwargs.get("device", args[0].device)
            if torch.device(target) != args[0].device:
                return self._copy(args[0], torch.device(target), kwargs, func, args)
        if func is aten.copy_.default and args[0].device != args[1].device:
            non_blocking = bool(args[2]) if len(args) > 2 else kwargs.get("non_blocking", False)
            if not non_blocking:
                raise HostSync(f"blocking copy {args[1].device} -> {args[0].device}")
            self.async_copies += 1
            if args[0].device.type == "cpu":
                return args[0]  # device -> host, asynchronous: the data comes later
        return func(*args, **kwargs)

    def _copy(self, src: torch.Tensor, target: torch.device, kwargs: dict, func: Any,
              args: Any) -> torch.Tensor:
        if not kwargs.get("non_blocking", False):
            raise HostSync(f"blocking copy {src.device} -> {target}")
        self.async_copies += 1
        if target.type == "cpu":
            return torch.empty(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        return func(*args, **kwargs)


def meta_recorder(module: Any = recorder_module, num_layers: int = 2,
                  layer_ids: tuple[int, ...] | None = None):
    """A recorder and its MoE layers with every device tensor on ``meta``, as vLLM builds them
    under its device context."""
    with META:
        layers = [FakeMoELayer(8) for _ in range(num_layers)]
        for layer in layers:
            assert attach(layer, 8)
    recorder = module.SignatureRecorder(num_blocks=4, block_size=4, max_tokens=8)
    ids = layer_ids or tuple(range(num_layers))
    recorder.bind_layers(list(zip(ids, layers, strict=True)), META)
    return recorder, layers


def run_steps(recorder: Any, layers: list[FakeMoELayer], mode: FailsOnHostSync) -> list[Any]:
    """A prefill step (prompt complete, a prefix-hit slot to skip, a token without a slot)
    and a decode-only step with decode counting, as a prefill or capture worker runs them."""
    steps = [
        (StepPlan(num_tokens=5, snapshots={"a": [2, 3]}, skip_slots=[9]),
         [8, 9, 10, 11, -1]),
        (StepPlan(num_tokens=2, decode_slots={"a": [12], "b": [13]}, decode_only=True,
                  snapshots={"b": [3]}),
         [12, 13]),
    ]
    reports = []
    for plan, slots in steps:
        slot_tensor = torch.tensor(slots, device=META)
        picks = torch.zeros((len(slots), 2), dtype=torch.int64, device=META)
        with mode:
            recorder.begin_step(plan)
            for layer in layers:
                layer(picks)
            reports.append(recorder.end_step(slots=slot_tensor))
    return reports


def test_per_step_path_never_waits_for_the_device() -> None:
    recorder, layers = meta_recorder()
    mode = FailsOnHostSync()
    reports = run_steps(recorder, layers, mode)
    assert all(isinstance(r, StepReport) and r.pending is not None for r in reports)
    # The index lists went in and the results came out, all without blocking.
    assert mode.async_copies >= 4


def test_the_check_catches_the_previous_recorder(tmp_path: Path) -> None:
    """The dispatch mode is no rubber stamp: the recorder as it was before (blocking
    ``torch.tensor(..., device=)``, ``.cpu()``, ``bool(any())``) fails it."""
    old = subprocess.run(
        ["git", "show", "fc8d235:stages/capture/recorder.py"], capture_output=True, text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    if old.returncode != 0:
        pytest.skip("the previous recorder is not in this clone's history")
    path = tmp_path / "old_recorder.py"
    path.write_text(old.stdout)
    spec = importlib.util.spec_from_file_location("old_recorder", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_recorder"] = module
    try:
        spec.loader.exec_module(module)
        recorder, layers = meta_recorder(module)
        with pytest.raises(HostSync):
            run_steps(recorder, layers, FailsOnHostSync())
    finally:
        del sys.modules["old_recorder"]


def cpu_recorder(layer_ids: tuple[int, ...] = (1, 3)):
    layers = [FakeMoELayer(8) for _ in layer_ids]
    for layer in layers:
        assert attach(layer, 8)
    recorder = recorder_module.SignatureRecorder(num_blocks=4, block_size=4, max_tokens=8)
    recorder.bind_layers(list(zip(layer_ids, layers, strict=True)), torch.device("cpu"))
    return recorder, layers


def test_ids_the_forward_did_not_write_are_never_counted() -> None:
    recorder, layers = cpu_recorder()
    recorder.CHECK_FIRST_STEPS = 2  # only the first two steps with tokens are checked
    recorder.CHECK_EVERY = 1000
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    # Step 1 (checked): the hook runs and records 3 tokens into blocks 0 and 1.
    recorder.begin_step(StepPlan(num_tokens=3))
    for layer in layers:
        layer(ids)
    end(recorder, torch.tensor([0, 1, 4]))
    before = recorder.table.clone()
    # Step 2 (checked): the forward writes nothing, the buffers keep UNWRITTEN.
    recorder.begin_step(StepPlan(num_tokens=3))
    report = end(recorder, torch.tensor([2, 3, 5]))
    assert report.unrecorded_steps == 1
    # Step 3 (not checked): again nothing written; the buffers still hold UNWRITTEN (-1),
    # which once became "the previous layer's last expert", or index -1 for block 0.
    recorder.begin_step(StepPlan(num_tokens=3, snapshots={"a": [0, 1]}))
    report = end(recorder, torch.tensor([0, 6, 7]))  # slot 0: block 0, layer 0
    assert report.unrecorded_steps == 0  # an unchecked step cannot tell
    rows = slice(0, recorder.num_blocks)
    # Block 0 was re-allocated (slot 0 written) and reset; nothing else moved.
    assert not recorder.table[0].any()
    torch.testing.assert_close(recorder.table[1:rows.stop], before[1:rows.stop])
    np.testing.assert_array_equal(report.signatures["a"], before[1].numpy())


def steps_on(recorder: Any, layers: list[FakeMoELayer], picks: torch.Tensor) -> list[StepReport]:
    """The same two steps on a recorder holding some of the model's layers; ``picks`` holds
    every layer's ids ``[num_layers_total, tokens, k]``, indexed by the recorder's layer ids."""
    reports = []
    plans = [
        (StepPlan(num_tokens=3, snapshots={"a": [0]}), [0, 1, 2], slice(0, 3)),
        (StepPlan(num_tokens=2, decode_slots={"a": [3], "b": [4]}, decode_only=True,
                  snapshots={"b": [1]}), [3, 4], slice(3, 5)),
    ]
    for plan, slots, tokens in plans:
        recorder.begin_step(plan)
        for layer_id, layer in zip(recorder.layer_ids, layers, strict=True):
            layer(picks[layer_id, tokens])
        report = recorder.end_step(slots=torch.tensor(slots))
        assert report is not None
        # Stages live in other processes: their reports arrive pickled.
        reports.append(pickle.loads(pickle.dumps(report)))
    return reports


def test_pipeline_stages_merge_into_the_whole_models_report() -> None:
    picks = torch.randint(0, 4, (4, 5, 2))
    whole = steps_on(*cpu_recorder((0, 1, 2, 3)), picks)
    # Two stages holding layers {0, 2} and {1, 3} (any split keeps layer order by index).
    first = steps_on(*cpu_recorder((0, 2)), picks)
    second = steps_on(*cpu_recorder((1, 3)), picks)
    for want, a, b in zip(whole, first, second, strict=True):
        got = b.aggregate(a)  # vLLM merges in rank order; either order gives the same
        assert isinstance(got, StepReport)
        assert got.moe_layers == want.moe_layers == (0, 1, 2, 3)
        assert got.signatures.keys() == want.signatures.keys()
        for req_id, counts in want.signatures.items():
            np.testing.assert_array_equal(got.signatures[req_id], counts)
        for req_id, counts in want.decode_counts.items():
            np.testing.assert_array_equal(got.decode_counts[req_id], counts)
        if want.active_experts is not None:
            np.testing.assert_array_equal(got.active_experts, want.active_experts)
            assert got.decode_tokens == want.decode_tokens


def test_tensor_parallel_replicas_are_not_double_counted() -> None:
    picks = torch.randint(0, 4, (2, 5, 2))
    one = steps_on(*cpu_recorder((0, 1)), picks)
    other = steps_on(*cpu_recorder((0, 1)), picks)
    merged = one[0].aggregate(other[0])
    assert isinstance(merged, StepReport)
    np.testing.assert_array_equal(merged.signatures["a"], one[0].signatures["a"])


def test_a_step_split_into_micro_batches_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.forward_context as fc

    parts = [{"attn": torch.tensor([0, 1])}, {"attn": torch.tensor([2, 3])}]
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: SimpleNamespace(slot_mapping=parts))
    with pytest.raises(RuntimeError, match="micro-batches"):
        recorder_module.current_slot_mapping("attn")
    monkeypatch.setattr(fc, "get_forward_context",
                        lambda: SimpleNamespace(slot_mapping=parts[:1]))
    assert recorder_module.current_slot_mapping("attn").tolist() == [0, 1]


@pytest.mark.parametrize(("layout", "named"), [
    (ParallelLayout(data=2), "data parallel (--data-parallel-size 2)"),
    (ParallelLayout(tensor=2, data=2), "data parallel"),
    (ParallelLayout(micro_batches=2), "--enable-dbo"),
    (ParallelLayout(decode_context=2), "context parallel"),
    (ParallelLayout(prefill_context=2), "context parallel"),
    (ParallelLayout(pipeline=2, on_cpu=True), "pipeline parallel (--pipeline-parallel-size 2)"),
    (ParallelLayout(tensor=2, expert=True, on_cpu=True), "expert parallel"),
])
def test_layouts_eldr_cannot_record_are_refused_by_name(
    layout: ParallelLayout, named: str
) -> None:
    with pytest.raises(RuntimeError, match="eldr cannot record") as refused:
        check_layout(layout)
    assert named in str(refused.value)


@pytest.mark.parametrize("layout", [
    ParallelLayout(), ParallelLayout(tensor=2, on_cpu=True), ParallelLayout(tensor=8),
    ParallelLayout(pipeline=2, tensor=4), ParallelLayout(tensor=4, pipeline=2, on_cpu=False),
    ParallelLayout(tensor=8, expert=True),
])
def test_layouts_eldr_records(layout: ParallelLayout) -> None:
    check_layout(layout)


def test_layout_is_read_off_vllms_parallel_config() -> None:
    from vllm.config import ParallelConfig

    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=1)
    assert ParallelLayout.of_engine(config, on_cpu=True) == ParallelLayout(tensor=2, on_cpu=True)
    config.enable_dbo = True
    config.enable_expert_parallel = True
    layout = ParallelLayout.of_engine(config, on_cpu=False)
    assert (layout.micro_batches, layout.expert) == (2, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_per_step_path_never_syncs_and_counts_as_on_cpu() -> None:
    """The same steps on a real GPU under ``set_sync_debug_mode("error")`` (scripts/
    gpu-check.sh), and the results equal the CPU recorder's."""
    cuda = torch.device("cuda")
    with cuda:
        gpu_layers = [FakeMoELayer(8) for _ in range(2)]
        for layer in gpu_layers:
            assert attach(layer, 8)
    gpu = recorder_module.SignatureRecorder(num_blocks=4, block_size=4, max_tokens=8)
    gpu.bind_layers(list(zip((1, 3), gpu_layers, strict=True)), cuda)
    gpu.GPU_STATS_EVERY = 1  # so this short run takes decode-step statistics too
    cpu, cpu_layers = cpu_recorder((1, 3))
    picks = torch.randint(0, 4, (4, 5, 2))
    plans = [
        (StepPlan(num_tokens=3, snapshots={"a": [0]}, skip_slots=[1]), [0, 1, 2], slice(0, 3)),
        (StepPlan(num_tokens=2, decode_slots={"a": [3], "b": [4]}, decode_only=True,
                  snapshots={"b": [1]}), [3, 4], slice(3, 5)),
    ]
    inputs = [(plan, torch.tensor(s), torch.tensor(s, device=cuda), t) for plan, s, t in plans]
    device_picks = picks.to(cuda)
    torch.cuda.synchronize()
    reports = []
    for plan, slots, device_slots, tokens in inputs:
        torch.cuda.set_sync_debug_mode("error")
        try:
            gpu.begin_step(plan)
            for layer_id, layer in zip(gpu.layer_ids, gpu_layers, strict=True):
                layer(device_picks[layer_id, tokens])
            report = gpu.end_step(slots=device_slots)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        cpu.begin_step(plan)
        for layer_id, layer in zip(cpu.layer_ids, cpu_layers, strict=True):
            layer(picks[layer_id, tokens])
        reports.append((report, end(cpu, slots)))
    for on_gpu, on_cpu in reports:
        assert on_gpu is not None
        on_gpu.resolve()
        for req_id, counts in on_cpu.signatures.items():
            np.testing.assert_array_equal(on_gpu.signatures[req_id], counts)
        for req_id, counts in on_cpu.decode_counts.items():
            np.testing.assert_array_equal(on_gpu.decode_counts[req_id], counts)
        if on_cpu.active_experts is not None:
            np.testing.assert_array_equal(on_gpu.active_experts, on_cpu.active_experts)
            assert on_gpu.decode_seconds > 0
