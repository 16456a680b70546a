"""eldr capture runs the serve self-check on its own engine before it records anything."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from stages.capture.runner import EngineProbe, check_engine_records
from stages.errors import EldrError
from stages.serve.proxy.ops.self_check import PROBE_PROMPT, check_signature
from stages.signature import wire
from stages.signature.dataset import ModelIdentity
from tests.conftest import requires_vllm

pytestmark = requires_vllm
MODEL = SimpleNamespace(identity=ModelIdentity("m", 2, 4, 2, (1, 2)))
# What `eldr capture` hands the runner.
PROBE = EngineProbe(PROBE_PROMPT, check_signature)


class Engine:
    """An in-process engine answering every prompt with ``params``."""

    def __init__(self, params: dict[str, Any] | None) -> None:
        self.params = params
        self.prompts: list[Any] = []

    def generate(self, prompts: list[Any], params: Any, use_tqdm: bool) -> list[Any]:
        self.prompts.extend(prompts)
        assert params.max_tokens == 1 and params.temperature == 0.0
        return [SimpleNamespace(kv_transfer_params=self.params) for _ in prompts]


def test_an_engine_that_records_passes() -> None:
    engine = Engine(wire.encode(np.full((2, 4), 3, np.int32), (1, 2)))
    check_engine_records(engine, MODEL, PROBE)
    assert engine.prompts == [PROBE_PROMPT]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (None, "eldr capture's vLLM engine returns no expert signature"),
        (wire.encode(np.ones((3, 4), np.int32), (1, 2)), "records signatures of shape"),
        (wire.encode(np.zeros((2, 4), np.int32), (1, 2)), "empty expert signature"),
    ],
)
def test_an_engine_that_records_wrong_is_refused(params: Any, message: str) -> None:
    with pytest.raises(EldrError, match=message):
        check_engine_records(Engine(params), MODEL, PROBE)
