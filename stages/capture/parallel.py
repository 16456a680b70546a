"""Which parallel layouts of a vLLM engine eldr records right, and which it refuses.

A signature must count every prompt token of one request once, in every MoE layer, with each
token's picks filed under the KV block that token's KV lands in. That holds when:

- tensor parallel (TP): every rank routes every token of the step alike (the gate is
  replicated), so the first rank of each pipeline stage records and the others do not;
- expert parallel over TP ranks only (``--enable-expert-parallel``, DP=1): experts are sharded,
  the tokens and the routing are not; vLLM hands the hook logical expert ids (before EPLB's
  mapping), so EPLB is fine too. vLLM 0.32's CPU build crashes with it (a segfault in
  ``cpu_fused_moe``, with or without eldr), so on CPU it is refused here;
- pipeline parallel (PP): each stage records its own MoE layers and vLLM merges the stages'
  reports (``StepReport.aggregate``); vLLM's CPU build fails at PP > 1 itself, so on CPU it is
  refused here rather than left to fail deep in a worker.

It does not hold, and the engine is refused at start with the mode named, for:

- data parallel (DP > 1, with or without EP): MoE layers gather the tokens of every DP rank
  before routing, so the hook sees other engines' tokens in rows it would file as this one's;
- micro-batching (dual-batch overlap ``--enable-dbo``, ``--ubatch-size``): each micro-batch
  writes its ids from row 0 of the same buffer, so ids and KV slots would not line up;
- context parallel (prefill or decode, PCP/DCP > 1): a rank holds only part of a request's
  KV, so its blocks are not the request's blocks;
- speculative decoding (EAGLE, MTP, n-gram, a draft model): the verify step routes every draft
  position, rejected ones too, so decode counts would include tokens never generated, and a
  drafter with MoE layers (EAGLE, MTP) runs the router hook on its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelLayout:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    prefill_context: int = 1
    decode_context: int = 1
    micro_batches: int = 1  # 2 with dual-batch overlap, ubatch_size otherwise
    expert: bool = False  # --enable-expert-parallel
    on_cpu: bool = False
    speculative: str = ""  # the speculative decoding method, "" without

    @classmethod
    def of_engine(cls, parallel_config: Any, on_cpu: bool,
                  speculative_config: Any = None) -> ParallelLayout:
        """From vLLM's ``ParallelConfig`` and ``SpeculativeConfig`` (None: no drafting)."""
        def size(name: str) -> int:
            return int(getattr(parallel_config, name, 1) or 1)

        micro = 2 if getattr(parallel_config, "enable_dbo", False) else size("ubatch_size")
        return cls(
            tensor=size("tensor_parallel_size"), pipeline=size("pipeline_parallel_size"),
            data=size("data_parallel_size"),
            prefill_context=size("prefill_context_parallel_size"),
            decode_context=size("decode_context_parallel_size"),
            micro_batches=micro,
            expert=bool(getattr(parallel_config, "enable_expert_parallel", False)),
            on_cpu=on_cpu,
            speculative="" if speculative_config is None else describe_speculative(
                getattr(speculative_config, "method", None),
                getattr(speculative_config, "model", None),
                getattr(speculative_config, "num_speculative_tokens", None)),
        )

    def refusal(self) -> str | None:
        """Why eldr cannot record this layout right, or None when it can."""
        if self.data > 1:
            return (
                f"data parallel (--data-parallel-size {self.data}): vLLM's MoE layers gather"
                " every DP rank's tokens before routing, so one engine's expert ids cannot be"
                " told apart from another's. Run one engine per worker (DP=1; TP and expert"
                " parallel over TP ranks are supported) and let eldr route between them"
            )
        if self.micro_batches > 1:
            return (
                "micro-batching (--enable-dbo or --ubatch-size > 1): each micro-batch writes"
                " its expert ids from the first row of the same buffer, so ids and KV slots"
                " would not line up. Start the worker without dual-batch overlap"
            )
        if self.prefill_context > 1 or self.decode_context > 1:
            return (
                "context parallel (--prefill-context-parallel-size /"
                " --decode-context-parallel-size > 1): a rank holds only part of a request's"
                " KV blocks, so its signature table cannot sum a request's prompt"
            )
        if self.speculative:
            return (
                f"speculative decoding ({self.speculative}): vLLM routes every draft position"
                " through the MoE layers, rejected ones too, so a request's decode counts"
                " would include tokens it never generated, and a drafter with MoE layers"
                " (EAGLE, MTP) would record its own forward. Start the worker without"
                " --speculative-config"
            )
        if self.expert and self.on_cpu:
            return (
                "expert parallel (--enable-expert-parallel) on vLLM's CPU build, which crashes"
                " with it (a segfault in its fused MoE kernel, with or without eldr); eldr"
                " records EP over TP ranks on GPUs (scripts/gpu-check.sh)"
            )
        if self.pipeline > 1 and self.on_cpu:
            return (
                f"pipeline parallel (--pipeline-parallel-size {self.pipeline}) on vLLM's CPU"
                " build, which fails at PP > 1 itself; eldr records PP on GPUs"
                " (scripts/gpu-check.sh). Use --tensor-parallel-size on CPU"
            )
        return None


def describe_speculative(method: str | None, model: str | None, tokens: int | None) -> str:
    """``"eagle, 2 draft tokens"``: the method as vLLM infers it when only a model is named
    (n-gram, else a draft model)."""
    name = method or ("ngram" if model in ("ngram", "[ngram]") else "draft model")
    return f"{name}, {tokens} draft tokens" if tokens else name


def check_layout(layout: ParallelLayout) -> None:
    """Refuse, with the mode named, a layout eldr would record wrong."""
    why = layout.refusal()
    if why is not None:
        raise RuntimeError(f"eldr cannot record expert signatures with {why}")
