"""Speculative decoding is refused at start, by name: its rejected draft positions would be
counted as decode, and a drafter with MoE layers (EAGLE, MTP) runs the router hook on tokens
that are not the request's. Checked on vLLM's own config objects, and on `--vllm-arg`."""

from __future__ import annotations

import json

import pytest

from stages.capture.parallel import ParallelLayout, check_layout
from stages.errors import EldrError
from stages.serve.cluster.engine_args import check_recordable


def test_an_engine_config_with_speculative_decoding_is_refused_by_method() -> None:
    from vllm.config import SpeculativeConfig, VllmConfig

    plain = VllmConfig()
    check_layout(ParallelLayout.of_engine(plain.parallel_config, False,
                                          plain.speculative_config))
    drafted = VllmConfig(speculative_config=SpeculativeConfig(method="ngram",
                                                              num_speculative_tokens=3))
    layout = ParallelLayout.of_engine(drafted.parallel_config, False,
                                      drafted.speculative_config)
    with pytest.raises(RuntimeError, match=r"speculative decoding \(ngram, 3 draft tokens\)"):
        check_layout(layout)


@pytest.mark.parametrize("args", [
    ["--speculative-config", json.dumps({"method": "eagle", "model": "x/EAGLE",
                                         "num_speculative_tokens": 2})],
    ["-sc", '{"method": "mtp", "num_speculative_tokens": 1}'],
    ["--spec-method", "ngram", "--spec-tokens", "4"],
    ["--speculative-config={\"model\": \"ngram\", \"num_speculative_tokens\": 4}"],
])
def test_a_worker_started_with_speculative_decoding_is_refused_before_it_starts(
        args: list[str]) -> None:
    with pytest.raises(EldrError, match=r"decode workers: .*speculative decoding"):
        check_recordable(args, 1, False, "decode")


def test_a_speculative_config_that_is_not_json_is_a_clear_error() -> None:
    with pytest.raises(EldrError, match="--speculative-config"):
        check_recordable(["--speculative-config", "{eagle"], 1, False, "decode")
