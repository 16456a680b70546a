"""Simulated conversations: token ids of every turn's prompt, built up front.

Each conversation has a system prompt (one of ``system_prompts`` shared ones), then per turn a
user message (log-normal length around ``message_tokens``) and an answer of
``output_tokens`` (its own random ids: the next turn's prompt holds it, as a chat history
holds the server's answer). Turn k's prompt = system + every earlier (message, answer) + the
new message; when that plus its answer would pass ``max_model_len``, the oldest pairs go (as
``workloads.conversations.History``). A conversation keeps one signature row of the dataset
for all its turns: a user stays on a topic, so its experts do too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.errors import EldrError


@dataclass(frozen=True)
class SimConversationSpec:
    conversations: int = 600
    turns: int = 3
    conversation_rate: float = 4.0  # new conversations per second (Poisson)
    think_time_s: float = 2.0
    system_prompts: int = 4
    system_tokens: int = 1024
    message_tokens: int = 256  # median
    output_tokens: int = 256
    max_model_len: int = 32768
    vocab: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompts", "message_tokens",
                     "output_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise EldrError(f"{name.replace('_', ' ')} must be >= 1, got"
                                f" {getattr(self, name)}")
        if not self.conversation_rate > 0:
            raise EldrError(f"conversation rate must be > 0, got {self.conversation_rate}")
        if not self.think_time_s >= 0:
            raise EldrError(f"think time must be >= 0 s, got {self.think_time_s}")
        if self.system_tokens + 4 * self.message_tokens + self.output_tokens > self.max_model_len:
            raise EldrError("a first turn would not fit the model's length: lower the system"
                            " prompt, message or output tokens")


@dataclass(frozen=True)
class SimTurns:
    """Every turn of every conversation, flattened; a conversation's turns are consecutive."""

    prompts: list[np.ndarray]  # int64 token ids per turn
    answers: list[np.ndarray]  # int64 token ids per turn
    conversation: np.ndarray  # int64 [N]
    turn: np.ndarray  # int64 [N], 1-based
    row: np.ndarray  # int64 [N]: the signature row of its conversation
    start_s: np.ndarray  # float64 [C]: each conversation's first turn arrival

    def __len__(self) -> int:
        return len(self.prompts)


def build_turns(spec: SimConversationSpec, num_rows: int) -> SimTurns:
    if num_rows < 1:
        raise EldrError("no signature rows to give the conversations")
    rng = np.random.default_rng([spec.seed, 7])
    systems = [rng.integers(4, spec.vocab, spec.system_tokens) for _ in range(spec.system_prompts)]
    prompts, answers, conv, turn, row = [], [], [], [], []
    for c in range(spec.conversations):
        system = systems[int(rng.integers(spec.system_prompts))]
        r = int(rng.integers(num_rows))
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        for k in range(spec.turns):
            length = int(np.clip(rng.lognormal(np.log(spec.message_tokens), 0.5), 8,
                                 4 * spec.message_tokens))
            message = rng.integers(4, spec.vocab, length)
            while True:
                prompt = np.concatenate([system, *(t for p in pairs for t in p), message])
                if prompt.size + spec.output_tokens <= spec.max_model_len or not pairs:
                    break
                pairs.pop(0)
            answer = rng.integers(4, spec.vocab, spec.output_tokens)
            prompts.append(prompt.astype(np.int64))
            answers.append(answer.astype(np.int64))
            conv.append(c)
            turn.append(k + 1)
            row.append(r)
            pairs.append((message, answer))
    gaps = rng.exponential(1.0 / spec.conversation_rate, size=spec.conversations)
    start = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    return SimTurns(prompts, answers, np.array(conv), np.array(turn), np.array(row), start)
