"""``eldr bench --workload conversations|sharegpt``: resolve what to drive and where the
workers' counters are, run every router on fresh conversations, print and save the table."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from stages.bench.live.admin import ProxyAdmin, decode_worker_urls
from stages.bench.live.cache_counters import worker_block_size
from stages.bench.live.conversation_run import (
    ConversationBenchConfig,
    ConversationSource,
    run_conversations,
    seeded_draw,
)
from stages.bench.live.conversation_summary import (
    conversation_metrics,
    save_conversation_results,
)
from stages.bench.report import format_conversations
from stages.bench.workloads.chat_tokens import ChatTokenizer, cut_to_tokens
from stages.bench.workloads.conversations import (
    Conversation,
    ConversationSpec,
    generate_conversations,
)
from stages.errors import EldrError
from stages.prompts import load_prompts

DEFAULT_BLOCK_SIZE = 32  # vLLM's CPU attention default


@dataclass(frozen=True)
class WorkloadChoice:
    kind: str  # "conversations" or "sharegpt"
    spec: ConversationSpec
    prompts_path: Path
    sharegpt_path: Path | None = None


def conversation_source(choice: WorkloadChoice, tokenizer: ChatTokenizer, seed: int
                        ) -> ConversationSource:
    if choice.kind == "conversations":
        prompts = load_prompts(choice.prompts_path)
        return lambda run_index, salt: generate_conversations(
            prompts, choice.spec, tokenizer, seed, salt)
    if choice.kind == "sharegpt":
        from stages.bench.workloads.sharegpt import load_sharegpt

        if choice.sharegpt_path is None:
            raise EldrError("--workload sharegpt needs the file: --workload sharegpt FILE")
        items = load_sharegpt(choice.sharegpt_path)
        draw = seeded_draw(items, choice.spec.conversations, seed)
        limit = choice.spec.message_tokens

        def cut(run_index: int, salt: str) -> list[Conversation]:
            # A ShareGPT message can outgrow a small model's whole length on its own.
            return [replace(c, user_messages=tuple(cut_to_tokens(tokenizer, m, limit)
                                                   for m in c.user_messages))
                    for c in draw(run_index, salt)]

        return cut
    raise EldrError(f"unknown workload {choice.kind!r}; choose conversations or sharegpt")


def _prefill_urls(state: dict[str, object]) -> tuple[str, ...]:
    workers = state.get("prefill_workers")
    if not isinstance(workers, list):
        return ()
    return tuple(w["url"] for w in workers if isinstance(w, dict) and isinstance(w.get("url"),
                                                                                 str))


async def _resolve(config: ConversationBenchConfig, prefill: tuple[str, ...] | None,
                   decode: tuple[str, ...] | None, block_size: int | None
                   ) -> tuple[ConversationBenchConfig, int, str | None]:
    """Worker URLs from the eldr proxy's state where not given; the block size from a
    worker's cache config; the served model's name."""
    proxy = next((t.url for t in config.targets if t.switches_policy), None)
    model = config.model
    async with httpx.AsyncClient() as client:
        if proxy is not None:
            admin = ProxyAdmin(client, proxy)
            state = await admin.state()
            prefill = _prefill_urls(state) if prefill is None else prefill
            decode = decode_worker_urls(state) if decode is None else decode
            model = model or await admin.served_model()
        if model is None:
            # Named in every request: a router in front of the workers (vllm-router) may
            # route or refuse by the model field.
            model = await ProxyAdmin(client, config.targets[0].url).served_model()
        prefill, decode = prefill or (), decode or ()
        if block_size is None:
            found = await worker_block_size(client, prefill[0]) if prefill else None
            block_size = found or DEFAULT_BLOCK_SIZE
    return (replace(config, prefill_urls=prefill, decode_urls=decode, model=model), block_size,
            model)


def run_conversation_bench(config: ConversationBenchConfig, prefill: tuple[str, ...] | None,
                           decode: tuple[str, ...] | None, block_size: int | None,
                           result_dir: Path, describe: str, echo: Callable[[str], None]
                           ) -> dict[str, dict[str, object]]:
    config, block_size, model = asyncio.run(_resolve(config, prefill, decode, block_size))
    if not config.prefill_urls:
        echo("no prefill worker URLs (--prefill-urls, or an eldr policy to read them from):"
             " no prefix-hit shares")
    outcomes = asyncio.run(run_conversations(config, echo))
    names = [t.name for t in config.targets]
    metrics = conversation_metrics(outcomes, names, block_size)
    echo(format_conversations(metrics, describe))
    info: dict[str, object] = {
        "workload": describe, "model_id": model, "block_size": block_size,
        "max_concurrency": config.max_concurrency, "max_tokens": config.max_tokens,
        "think_time_s": config.think_time_s, "turns_per_conversation": config.turns,
        "rounds": config.rounds, "seed": config.seed,
        "targets": {t.name: {"url": t.url, "policy": t.policy,
                             "options": None if t.options is None else dict(t.options)}
                    for t in config.targets},
        "prefill_urls": list(config.prefill_urls), "decode_urls": list(config.decode_urls),
        "run_order": [o.target for o in outcomes],
    }
    for path in save_conversation_results(outcomes, metrics, info, result_dir):
        echo(f"results: {path}")
    return metrics
