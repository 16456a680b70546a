"""Capture building blocks without an engine: the graph-safe top-k op, the ledger's checks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stages.capture.ledger import SignatureLedger
from stages.capture.messages import StepReport
from stages.capture.topk_sink import UNWRITTEN, records_signatures
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
