"""Capture building blocks without an engine: the graph-safe top-k op, the ledger's checks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stages.capture.ledger import SignatureLedger
from stages.capture.messages import StepPlan, StepReport
from stages.capture.recorder import SignatureRecorder
from stages.capture.topk_sink import UNWRITTEN, attach, records_signatures
from stages.engine import kv_transfer_config


class RoutesAndRecords(torch.nn.Module):
    """A router in miniature: top-k of logits, recorded through eldr's op into a buffer."""

    def __init__(self, max_tokens: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.register_buffer(
            "ids", torch.full((max_tokens, top_k), UNWRITTEN, dtype=torch.int32),
            persistent=False,
        )

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        topk = torch.topk(logits, self.top_k, dim=-1).indices
        torch.ops.eldr.record_topk(self.ids, topk)
        return logits * 2


@pytest.mark.parametrize("backend", ["aot_eager"])  # inductor: the real-vLLM tests
def test_record_op_survives_torch_compile(backend: str) -> None:
    module = RoutesAndRecords(max_tokens=16, top_k=2)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=True)
    for tokens in (5, 9):
        logits = torch.randn(tokens, 8)
        module.ids.fill_(UNWRITTEN)
        compiled(logits)
        expected = torch.topk(logits, 2, dim=-1).indices.to(torch.int32)
        torch.testing.assert_close(module.ids[:tokens], expected)
        assert (module.ids[tokens:] == UNWRITTEN).all()  # rows past the batch stay unwritten


def test_record_op_clamps_to_its_buffer() -> None:
    buffer = torch.full((4, 2), UNWRITTEN, dtype=torch.int32)
    torch.ops.eldr.record_topk(buffer, torch.arange(12).view(6, 2))
    torch.testing.assert_close(buffer, torch.arange(8, dtype=torch.int32).view(4, 2))


def test_recording_is_on_only_for_engines_with_eldrs_connector() -> None:
    def config(kv: dict | None) -> SimpleNamespace:
        if kv is None:
            return SimpleNamespace(kv_transfer_config=None)
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(
            kv_connector=kv["kv_connector"],
            kv_connector_extra_config=kv.get("kv_connector_extra_config")))

    assert records_signatures(config(kv_transfer_config("plain")))
    assert records_signatures(config(kv_transfer_config("decode")))  # inside MultiConnector
    assert not records_signatures(config({"kv_connector": "NixlConnector"}))
    assert not records_signatures(config(None))


def scheduled(req_id: str, prompt_len: int, blocks: list[int]) -> SimpleNamespace:
    """A scheduler output that runs one whole prompt in one step."""
    new = SimpleNamespace(req_id=req_id, prompt_token_ids=list(range(prompt_len)),
                          block_ids=(blocks,), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                             num_computed_tokens=[])
    return SimpleNamespace(num_scheduled_tokens={req_id: prompt_len}, finished_req_ids=set(),
                           scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           total_num_scheduled_tokens=prompt_len)


def test_ledger_plans_the_step_token_count_and_counts_empty_signatures() -> None:
    ledger = SignatureLedger(block_size=16, shape=None, count_decode=False)
    plan = ledger.plan(scheduled("a", 20, [3, 4]))
    assert plan.num_tokens == 20  # the recorder's row count, never Python state of the forward
    assert plan.snapshots == {"a": [3, 4]}
    good = np.full((2, 4), 10, dtype=np.int32)
    ledger.apply(StepReport(signatures={"a": good}, moe_layers=(1, 2)))
    assert ledger.zero_signatures == 0
    params = ledger.finished("a")
    assert params["eldr_moe_layers"] == [1, 2]

    ledger.plan(scheduled("b", 20, [5, 6]))
    hole = good.copy()
    hole[1] = 0  # one MoE layer recorded nothing
    ledger.apply(StepReport(signatures={"b": hole}))
    assert ledger.zero_signatures == 1


class FakeMoELayer(torch.nn.Module):
    """What the recorder reads off a vLLM MoE layer: its router's expert count and the buffer
    eldr's construction hook attaches (through the real ``attach``)."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__()
        self.router = SimpleNamespace(global_num_experts=4, top_k=2,
                                      set_capture_fn=lambda fn: setattr(self, "hook", fn))

    def forward(self, topk_ids: torch.Tensor) -> None:
        self.hook(topk_ids)


def recorder_with_layers(max_tokens: int = 8) -> tuple[SignatureRecorder, list[FakeMoELayer]]:
    layers = [FakeMoELayer(max_tokens) for _ in range(2)]
    for layer in layers:
        assert attach(layer, max_tokens)
    recorder = SignatureRecorder(num_blocks=4, block_size=4, max_tokens=max_tokens)
    assert recorder.bind_layers([(1, layers[0]), (3, layers[1])], torch.device("cpu")) == 2
    return recorder, layers


def end(recorder: SignatureRecorder, slots: torch.Tensor) -> StepReport:
    """The step's report as the scheduler reads it (device results resolved)."""
    report = recorder.end_step(slots=slots)
    assert report is not None
    return report.resolve()


def test_recorder_sums_recorded_ids_into_kv_blocks() -> None:
    recorder, layers = recorder_with_layers()
    ids = torch.tensor([[0, 1], [0, 2], [3, 1], [0, 1], [2, 3]])  # 5 prompt tokens
    recorder.begin_step(StepPlan(num_tokens=5, snapshots={"a": [2, 3]}))
    for layer in layers:
        layer(ids)
    report = end(recorder, torch.tensor([8, 9, 10, 11, 12]))  # blocks 2 and 3
    assert report is not None and not report.unrecorded_steps
    assert report.moe_layers == (1, 3)
    expected = np.bincount(ids.flatten().numpy(), minlength=4)
    np.testing.assert_array_equal(report.signatures["a"], np.stack([expected, expected]))


def test_recorder_reports_a_step_whose_forward_did_not_record() -> None:
    recorder, layers = recorder_with_layers()
    recorder.begin_step(StepPlan(num_tokens=3, snapshots={"a": [0]}))
    layers[0](torch.tensor([[0, 1], [0, 2], [3, 1]]))  # the second layer's hook never ran
    report = end(recorder, torch.tensor([0, 1, 2]))
    assert report is not None and report.unrecorded_steps == 1
    # Nothing unwritten reached the table: the second layer's row stays empty (which the
    # ledger counts as a failed signature), the first layer's ids are counted.
    np.testing.assert_array_equal(report.signatures["a"][0], [2, 2, 1, 1])
    assert not report.signatures["a"][1].any()


def test_router_hook_records_when_the_layer_is_compiled() -> None:
    layer = FakeMoELayer(max_tokens=8)
    assert attach(layer, 8)
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm.code)
        return gm.forward

    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
    ids = torch.tensor([[3, 1], [0, 2], [1, 3]])
    compiled(ids)
    # The traced graph holds eldr's op (its mutation declared), not a bare in-place copy.
    assert any("eldr.record_topk" in code for code in graphs), graphs
    torch.testing.assert_close(layer.eldr_topk_ids[:3], ids.to(torch.int32))
    assert (layer.eldr_topk_ids[3:] == UNWRITTEN).all()


def kv_config(*specs: object) -> SimpleNamespace:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(kv_cache_groups=[
        KVCacheGroupSpec(layer_names=[f"model.layers.{i}.attn"], kv_cache_spec=spec)
        for i, spec in enumerate(specs)
    ])


def test_signatures_follow_a_full_attention_group_under_hma() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from stages.capture.kv_group import signature_group

    shape = dict(num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(block_size=16, sliding_window=32, **shape)
    full = FullAttentionSpec(block_size=32, **shape)
    # Sliding-window blocks are freed as the window moves: the full group is the one to sum.
    group = signature_group(kv_config(sliding, full))
    assert (group.index, group.block_size, group.layer_name) == (1, 32, "model.layers.1.attn")
    assert signature_group(kv_config(full)).index == 0  # no HMA: one group
    with pytest.raises(RuntimeError, match="no full-attention KV cache group"):
        signature_group(kv_config(sliding))

    ledger = SignatureLedger(block_size=32, shape=None, count_decode=False, group=1)
    step = scheduled("a", 40, [])
    step.scheduled_new_reqs[0].block_ids = ([7, 8, 9], [3, 4])  # (sliding, full)
    assert ledger.plan(step).snapshots == {"a": [3, 4]}


def test_recorder_leaves_out_unmapped_and_skipped_tokens_without_filtering() -> None:
    recorder, layers = recorder_with_layers()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]])
    # Slot -1: a token with no KV slot; slot 9 is re-written KV already in its block's row.
    recorder.begin_step(StepPlan(num_tokens=4, snapshots={"a": [2]}, skip_slots=[9]))
    for layer in layers:
        layer(ids)
    report = end(recorder, torch.tensor([8, -1, 9, 10]))
    assert report is not None
    expected = np.bincount(ids[[0, 3]].flatten().numpy(), minlength=4)
    np.testing.assert_array_equal(report.signatures["a"], np.stack([expected, expected]))
    # Block 2 reallocated (slot 8 written again): its row starts over.
    recorder.begin_step(StepPlan(num_tokens=1, snapshots={"b": [2]}))
    for layer in layers:
        layer(ids[:1])
    report = end(recorder, torch.tensor([8]))
    assert report is not None
    np.testing.assert_array_equal(report.signatures["b"][0], [1, 1, 0, 0])


_EPLB_LAYER = """
import sys
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
from stages.capture.recorder import SignatureRecorder
from stages.capture.topk_sink import attach


class NoWeights(torch.nn.Module):
    # vLLM's CPU build has no MoE kernel for EPLB; the routing side is what is checked.
    def __init__(self, *args, **kwargs):
        super().__init__()


with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
    initialize_model_parallel(1, 1)
    layer = FusedMoEFactory(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32,
                            enable_eplb=True, num_redundant_experts=2,
                            params_dtype=torch.float32, prefix="model.layers.0.mlp.experts",
                            routed_experts_cls=NoWeights)
assert attach(layer, 4)
recorder = SignatureRecorder(num_blocks=2, block_size=4, max_tokens=4)
recorder.bind_layers([(0, layer)], torch.device("cpu"))
print("physical", layer.router.global_num_experts, "table", recorder.num_experts)
"""


def test_eplb_redundant_experts_leave_the_table_at_the_logical_experts() -> None:
    """EPLB adds redundant (physical) experts; the router still picks logical ids, so the table
    (and the self-check's model identity) is as wide as the model's experts. A real vLLM MoE
    layer with 2 redundant experts, in a process of its own (it sets up vLLM's process
    groups)."""
    import subprocess
    import sys

    from tests.conftest import free_port

    done = subprocess.run([sys.executable, "-c", _EPLB_LAYER, str(free_port())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["physical", "10", "table", "8"], done.stdout
