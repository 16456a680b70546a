"""Conversations to replay: a system prompt and the user's messages, turn by turn.

The assistant's messages are not part of a conversation: a bench sends each turn with the
history holding the answers the server really returned (a prefix cache holds those, not a
dataset's). Every run draws its own conversations with its own ``salt`` at the head of each
system prompt, so no run finds another run's blocks in a worker's prefix cache (vLLM's caches
outlive a run: replaying a conversation through the next router would hand it the previous
router's cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stages.bench.workloads.chat_tokens import ChatTokenizer, Message, cut_to_tokens
from stages.errors import EldrError
from stages.prompts import Prompt


@dataclass(frozen=True)
class Conversation:
    id: str
    system: str  # "" for none
    user_messages: tuple[str, ...]
    domain: str = ""


@dataclass(frozen=True)
class ConversationSpec:
    """The bundled generator's shape (``eldr bench --workload conversations``)."""

    conversations: int = 12  # per run (each router or policy, each round)
    turns: int = 3
    system_prompts: int = 1  # distinct system prompts the conversations share
    system_tokens: int = 256  # length of each system prompt
    message_tokens: int = 128  # each user message is cut to this many tokens
    think_time_s: float = 1.0  # from an answer's end to the next turn's send

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompts", "message_tokens"):
            if getattr(self, name) < 1:
                raise EldrError(f"--{name.replace('_', '-')} must be >= 1,"
                                f" got {getattr(self, name)}")
        if self.system_tokens < 0:
            raise EldrError(f"--system-tokens must be >= 0, got {self.system_tokens}")
        if not self.think_time_s >= 0:
            raise EldrError(f"--think-time must be >= 0 s, got {self.think_time_s}")


def check_fits(spec: ConversationSpec, max_tokens: int, max_model_len: int) -> None:
    """Refuse a shape whose system prompt and first message cannot fit the model's length."""
    first = spec.system_tokens + spec.message_tokens + max_tokens + 16  # the template's tokens
    if first > max_model_len:
        raise EldrError(
            f"a first turn needs about {first} tokens (system {spec.system_tokens} + message"
            f" {spec.message_tokens} + answer {max_tokens}); the model takes {max_model_len}:"
            " lower --system-tokens, --message-tokens or --max-tokens"
        )


def generate_conversations(
    prompts: Sequence[Prompt], spec: ConversationSpec, tokenizer: ChatTokenizer,
    seed: int, salt: str,
) -> list[Conversation]:
    """``spec.conversations`` conversations drawn from ``prompts`` (seeded by ``seed`` and
    ``salt``): a conversation's messages come from one domain, as a user stays on a topic,
    and its system prompt is one of ``spec.system_prompts``, each headed by ``salt``."""
    if not prompts:
        raise EldrError("no prompts to build conversations from")
    rng = np.random.default_rng([seed, *salt.encode()])
    systems = [_system_prompt(prompts, rng, spec.system_tokens, tokenizer, salt, i)
               for i in range(spec.system_prompts)]
    by_domain: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_domain.setdefault(p.domain, []).append(p)
    domains = sorted(by_domain)
    out = []
    for c in range(spec.conversations):
        domain = domains[int(rng.integers(len(domains)))]
        pool = by_domain[domain]
        picks = rng.choice(len(pool), size=spec.turns, replace=len(pool) < spec.turns)
        messages = tuple(cut_to_tokens(tokenizer, pool[int(i)].prompt, spec.message_tokens)
                         for i in picks)
        out.append(Conversation(f"{salt}-c{c}", systems[c % len(systems)], messages, domain))
    return out


def _system_prompt(prompts: Sequence[Prompt], rng: np.random.Generator, tokens: int,
                   tokenizer: ChatTokenizer, salt: str, index: int) -> str:
    if tokens == 0:
        return ""
    head = f"Session {salt}, assistant {index}. Answer using these notes.\n"
    body = []
    while len(tokenizer.encode(head + "\n".join(body))) < tokens:
        body.append(prompts[int(rng.integers(len(prompts)))].prompt)
    return cut_to_tokens(tokenizer, head + "\n".join(body), tokens)


def salted(conversations: Sequence[Conversation], salt: str) -> list[Conversation]:
    """The same conversations under a system prompt headed by ``salt`` (a ShareGPT file's
    conversations, fresh for a run)."""
    return [Conversation(f"{salt}-{c.id}", f"Session {salt}.\n{c.system}".rstrip(),
                         c.user_messages, c.domain) for c in conversations]


class History:
    """One conversation's messages so far, capped in tokens: a turn whose prompt plus its
    answer would pass the model's length drops the oldest user/assistant pairs (the system
    prompt stays), as chat front-ends keep a window."""

    def __init__(self, conversation: Conversation, tokenizer: ChatTokenizer,
                 max_tokens: int) -> None:
        self.conversation = conversation
        self._tok = tokenizer
        self._max_tokens = max_tokens
        self._system = ([{"role": "system", "content": conversation.system}]
                        if conversation.system else [])
        self._pairs: list[tuple[Message, Message]] = []
        self.dropped_pairs = 0

    @property
    def budget(self) -> int:
        return self._tok.max_model_len - self._max_tokens

    def messages_for(self, turn: int) -> tuple[list[Message], list[int]]:
        """Messages of ``turn`` (0-based) and their rendered token ids."""
        user = {"role": "user", "content": self.conversation.user_messages[turn]}
        while True:
            messages = self._system + [m for pair in self._pairs for m in pair] + [user]
            ids = self._tok.render(messages)
            if len(ids) <= self.budget:
                return messages, ids
            if not self._pairs:
                raise EldrError(
                    f"conversation {self.conversation.id} turn {turn + 1}: {len(ids)} prompt"
                    f" tokens with no history; the model takes {self.budget} with"
                    f" {self._max_tokens} answer tokens"
                )
            self._pairs.pop(0)
            self.dropped_pairs += 1

    def answered(self, turn: int, answer: str) -> None:
        """Record the server's real answer to ``turn``."""
        user = {"role": "user", "content": self.conversation.user_messages[turn]}
        self._pairs.append((user, {"role": "assistant", "content": answer}))
