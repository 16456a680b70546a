"""Decode-step statistics of the eldr connector, exported through vLLM's Prometheus route.

``eldr_decode_active_experts_total / eldr_decode_steps_total / L`` is the mean number of
distinct experts per layer that a decode step read: the quantity expert-locality routing
lowers. ``eldr_decode_step_seconds_total`` gives the matching mean step time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from stages.capture.messages import StepReport

_FIELDS = (
    "decode_steps", "active_experts", "decode_seconds", "decode_tokens", "num_layers",
    "zero_signatures", "unrecorded_steps", "unknown_signatures", "unknown_blocks",
)


@dataclass
class EldrConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(_FIELDS, 0))

    def add_failures(self, zero_signatures: int, unrecorded_steps: int) -> None:
        self.data["zero_signatures"] += zero_signatures
        self.data["unrecorded_steps"] += unrecorded_steps

    def add_unknown(self, signatures: int, blocks: int) -> None:
        self.data["unknown_signatures"] += signatures
        self.data["unknown_blocks"] += blocks

    def add(self, report: StepReport) -> None:
        assert report.active_experts is not None
        self.data["decode_steps"] += report.decode_steps
        self.data["active_experts"] += int(report.active_experts.sum())
        self.data["decode_seconds"] += report.decode_seconds
        self.data["decode_tokens"] += report.decode_tokens
        self.data["num_layers"] = len(report.active_experts)

    def reset(self) -> None:
        self.data = dict.fromkeys(_FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _FIELDS:
            if key == "num_layers":
                self.data[key] = max(self.data.get(key, 0), other.data.get(key, 0))
            else:
                self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        steps = self.data.get("decode_steps", 0)
        layers = max(self.data.get("num_layers", 0), 1)
        if not steps:
            return {"decode_steps": 0}
        return {
            "decode_steps": steps,
            "distinct_experts_per_layer": round(self.data["active_experts"] / steps / layers, 3),
            "mean_step_ms": round(1000 * self.data["decode_seconds"] / steps, 3),
        }

    def is_empty(self) -> bool:
        return not any(
            self.data.get(key, 0)
            for key in ("decode_steps", "zero_signatures", "unrecorded_steps",
                        "unknown_signatures", "unknown_blocks")
        )


class EldrPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str) -> dict[int, Any]:
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.steps = counter("eldr_decode_steps", "Decode-only engine steps observed.")
        self.active = counter(
            "eldr_decode_active_experts",
            "Distinct experts read by decode steps, summed over MoE layers and steps.",
        )
        self.seconds = counter("eldr_decode_step_seconds", "Wall time of decode-only steps.")
        self.tokens = counter("eldr_decode_tokens", "Tokens processed by decode-only steps.")
        self.zero_signatures = counter(
            "eldr_zero_signatures",
            "Prompts whose expert signature came back empty (routed as 'no signature').",
        )
        self.unrecorded_steps = counter(
            "eldr_unrecorded_steps",
            "Engine steps whose forward did not record expert ids (hook missing from the graph).",
        )
        self.unknown_signatures = counter(
            "eldr_unknown_signatures",
            "Prompts given no signature because part of their prompt's KV was computed by"
            " another engine (loaded through the KV connector): its expert ids are unknown here.",
        )
        self.unknown_blocks = counter(
            "eldr_unknown_block_events",
            "Full KV blocks left out of the expert events: their KV was computed by another"
            " engine (loaded through the KV connector).",
        )
        self.layers = self._gauge_cls(
            name="eldr_moe_layers", documentation="MoE layers per step.", labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self.layers_per_engine = create_metric_per_engine(self.layers, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in (
            ("zero_signatures", self.zero_signatures), ("unrecorded_steps", self.unrecorded_steps),
            ("unknown_signatures", self.unknown_signatures),
            ("unknown_blocks", self.unknown_blocks),
        ):
            if transfer_stats_data.get(key):
                metric[engine_idx].inc(transfer_stats_data[key])
        if not transfer_stats_data.get("decode_steps"):
            return
        self.steps[engine_idx].inc(transfer_stats_data["decode_steps"])
        self.active[engine_idx].inc(transfer_stats_data["active_experts"])
        self.seconds[engine_idx].inc(transfer_stats_data["decode_seconds"])
        self.tokens[engine_idx].inc(transfer_stats_data["decode_tokens"])
        self.layers_per_engine[engine_idx].set(transfer_stats_data["num_layers"])
