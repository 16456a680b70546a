"""`eldr capture`: run prompts through real vLLM with the signature connector, store them.

The engine is vLLM's offline ``LLM`` (its engine core and worker are separate processes, the
same code the servers run), configured with eldr's connector alone and decode counting on.
Prompts go in batches; each finished batch is appended to the dataset, so an interrupted run
keeps what it finished and a re-run skips ids already stored.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stages.errors import EldrError
from stages.models import ResolvedModel, check_built_layers
from stages.procs.watchdog import Watchdog
from stages.prompts import Prompt
from stages.signature import wire
from stages.signature.dataset import (
    CaptureRecord,
    ModelIdentity,
    SignatureDataset,
    prompt_digest,
)


@dataclass(frozen=True)
class CaptureConfig:
    max_tokens: int = 32
    batch_size: int = 64
    max_model_len: int = 1024
    # Capture is offline batch work: wide decode batches keep the CPU busy.
    max_num_seqs: int = 32
    kv_cache_gib: int = 1
    seed: int = 0
    # vLLM's default is compiled (torch.compile, plus CUDA graphs on GPU); eager is a choice.
    enforce_eager: bool = False
    # One engine over this many devices (or CPU cores); signatures equal a single rank's.
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class EngineProbe:
    """The serve self-check, as capture's engine takes it before recording: the prompt it
    sends and the judge of the ``kv_transfer_params`` that come back (raises ``EldrError``).
    `eldr capture` hands in the proxy's (``stages.serve.proxy.ops.self_check``): capture sits
    below serve, so the two never disagree and capture never imports serve."""

    prompt: str
    check: Callable[[str, dict[str, Any] | None, ModelIdentity], None]


@dataclass(frozen=True)
class CaptureSummary:
    path: Path
    captured: int
    skipped: int
    total: int


def capture(
    model: ResolvedModel,
    prompts: Sequence[Prompt],
    out: Path,
    config: CaptureConfig,
    probe: EngineProbe,
    progress: Callable[[int], None] | None = None,
    status: Callable[[str], None] | None = None,
) -> CaptureSummary:
    """Capture the prompts not yet in ``out``, once the engine passed ``probe``; ``progress``
    hears of finished prompts and ``status`` of the phase (engine start-up, capturing)."""
    from stages.vllm_compat import check_vllm

    vllm_version = check_vllm()
    dataset = SignatureDataset.create_or_open(out, model.identity, vllm_version)
    done = dataset.ids()
    todo = [p for p in prompts if p.id not in done]
    skipped = len(prompts) - len(todo)
    if progress is not None and skipped:
        progress(skipped)
    if todo:
        if status is not None:
            mode = "eager" if config.enforce_eager else "compiled: the first start compiles"
            status(f"starting vLLM ({mode})")
        # vLLM's engine core and workers are this process's children: the watchdog kills
        # them if this process dies without shutting the engine down (SIGKILL included).
        with Watchdog():
            engine = _start_engine(model, config)
            if status is not None:
                status("capture")
            try:
                check_engine_records(engine, model, probe)  # before anything is recorded
                for batch in _batches(todo, config.batch_size):
                    dataset.append(_run_batch(engine, model, batch, config))
                    if progress is not None:
                        progress(len(batch))
            finally:
                _stop_engine(engine)
    return CaptureSummary(out, len(todo), skipped, len(dataset))


def _start_engine(model: ResolvedModel, config: CaptureConfig) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from stages.engine import kv_transfer_config, on_cpu, rank_binding

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
    tp = config.tensor_parallel_size
    if on_cpu() and tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        allowed = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = rank_binding(allowed, tp, allowed)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    extra: dict[str, Any] = {"dtype": "bfloat16"} if on_cpu() else {}
    return LLM(
        model=model.source,
        tensor_parallel_size=tp,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(**kv_transfer_config("plain", count_decode=True)),
        seed=config.seed,
        enforce_eager=config.enforce_eager,
        **extra,
    )


def check_engine_records(engine: Any, model: ResolvedModel, probe: EngineProbe) -> None:
    """The serve self-check on capture's own engine, before anything is recorded: its known
    prompt must come back with a signature of the model's shape, every MoE layer counted."""
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    output = engine.generate([probe.prompt], greedy, use_tqdm=False)[0]
    probe.check("eldr capture's vLLM engine", output.kv_transfer_params, model.identity)


def _stop_engine(engine: Any) -> None:
    shutdown = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    if shutdown is not None and hasattr(shutdown, "shutdown"):
        shutdown.shutdown()


def _batches(items: Sequence[Prompt], size: int) -> Iterator[Sequence[Prompt]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _run_batch(
    engine: Any, model: ResolvedModel, batch: Sequence[Prompt], config: CaptureConfig
) -> list[CaptureRecord]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0, ignore_eos=True)
    # Tokenised here, as the OpenAI server does, so an over-long prompt keeps its last tokens
    # (what decoding attends to most) instead of failing the whole batch.
    tokenizer = engine.get_tokenizer()
    keep = config.max_model_len - config.max_tokens
    inputs = [{"prompt_token_ids": tokenizer.encode(p.prompt)[-keep:]} for p in batch]
    outputs = engine.generate(inputs, params, use_tqdm=False)
    shape = model.identity.shape
    records = []
    for prompt, output in zip(batch, outputs, strict=True):
        kv = output.kv_transfer_params or {}
        prefill = wire.decode(kv, shape)
        decode = wire.decode(
            {wire.SIGNATURE_KEY: kv.get("eldr_decode_counts"), wire.SHAPE_KEY: list(shape)},
            shape,
        )
        if prefill is None or decode is None:
            raise EldrError(
                "vLLM returned no expert signature: is eldr installed in the environment vLLM"
                " runs in (`pip install -e .`), and is the model a supported MoE?"
            )
        built = wire.decode_moe_layers(kv)
        if built is not None:
            check_built_layers(model.identity, built, "vLLM")
        empty = wire.empty_layers(prefill)
        if len(output.prompt_token_ids) and len(empty):
            # Never store rows of a forward that ran without the recording hook.
            layers = [model.identity.moe_layers[i] for i in empty]
            raise EldrError(
                f"prompt {prompt.id!r} ({len(output.prompt_token_ids)} tokens) got no expert"
                f" counts in MoE layers {layers}: vLLM ran without eldr's recording hook (a"
                " compile cache from another vLLM build, or a MoE kernel that routes"
                " internally?). Nothing of this batch was stored; try --enforce-eager"
            )
        records.append(
            CaptureRecord(
                id=prompt.id,
                domain=prompt.domain,
                prompt_sha256=prompt_digest(prompt.prompt),
                prompt_tokens=len(output.prompt_token_ids),
                output_tokens=len(output.outputs[0].token_ids),
                prefill_counts=prefill.astype(np.int32),
                decode_counts=decode.astype(np.int32),
            )
        )
    return records
