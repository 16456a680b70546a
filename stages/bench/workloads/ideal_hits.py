"""The prefix-hit share a router could reach on a workload: every turn on a worker that holds
its history. Computed from the token ids the run sent, in send order, as one unbounded cache
(an upper bound on what any placement on real, finite caches can hit):

- ``history``: the worker holds every earlier prompt and answer (a decode worker, or a worker
  serving both legs);
- ``prefill``: it holds earlier prompts only (a PD prefill worker never computes the answer's
  KV: the decode worker generates it).

Hits follow vLLM's counting: whole blocks of the prompt's prefix, at most ``prompt - 1``
tokens, over all prompt tokens queried.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stages.bench.workloads.blocks import block_hashes, cacheable_blocks


@dataclass(frozen=True)
class SentTurn:
    """One turn as sent: its prompt's token ids and the answer's (as re-tokenized)."""

    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class IdealHits:
    prompt_tokens: int
    history_hit_tokens: int
    prefill_hit_tokens: int

    @property
    def prefill_share(self) -> float:
        return self.prefill_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _hit_tokens(prompt: Sequence[int], held: set[int], block_size: int) -> int:
    blocks = 0
    for h in block_hashes(prompt, block_size)[: cacheable_blocks(len(prompt), block_size)]:
        if h not in held:
            break
        blocks += 1
    return blocks * block_size


def ideal_hits(turns: Sequence[SentTurn], block_size: int) -> IdealHits:
    """``turns`` in send order (an answer counts once its turn was sent)."""
    with_answers: set[int] = set()
    prompts_only: set[int] = set()
    total = history = prefill = 0
    for turn in turns:
        total += len(turn.prompt_ids)
        history += _hit_tokens(turn.prompt_ids, with_answers, block_size)
        prefill += _hit_tokens(turn.prompt_ids, prompts_only, block_size)
        prompt_blocks = block_hashes(turn.prompt_ids, block_size)
        prompts_only.update(prompt_blocks)
        with_answers.update(prompt_blocks)
        with_answers.update(block_hashes(turn.prompt_ids + turn.answer_ids, block_size))
    return IdealHits(total, history, prefill)
