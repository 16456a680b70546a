"""The served model's tokenizer and chat template, as the workload needs them: to cap
histories in tokens below the model's length, to cut messages to a token budget, and to know
the token ids each turn sends (for the ideal hit share).

Chat completions: the bundled ``tiny`` model ships a chat template (``<s><|user|>\\n...</s>``),
so the conversation bench sends ``/v1/chat/completions`` and the server renders the history;
rendering it here with the same template gives the very token ids the worker caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from stages.errors import EldrError

Message = dict[str, str]  # {"role": ..., "content": ...}


class ChatTokenizer(Protocol):
    max_model_len: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of the chat prompt, generation prompt included, as the server renders."""
        ...


class HfChatTokenizer:
    """A Hugging Face tokenizer folder (``tokenizer.json`` plus its config and template)."""

    def __init__(self, path: Path, max_model_len: int | None = None) -> None:
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise EldrError(f"no tokenizer folder at {path} (give --tokenizer)")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise EldrError(f"cannot load the tokenizer in {path}: {exc}") from exc
        if not getattr(self._tok, "chat_template", None):
            raise EldrError(f"the tokenizer in {path} has no chat template; the conversation"
                            " bench sends chat completions")
        length = max_model_len or getattr(self._tok, "model_max_length", 0)
        if not isinstance(length, int) or not 0 < length < 10**8:
            raise EldrError(f"the tokenizer in {path} names no model length: give"
                            " --max-model-len")
        self.max_model_len = length

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def render(self, messages: Sequence[Message]) -> list[int]:
        ids = self._tok.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)


def cut_to_tokens(tokenizer: ChatTokenizer, text: str, max_tokens: int) -> str:
    """``text`` cut to at most ``max_tokens`` tokens (unchanged when shorter)."""
    ids = tokenizer.encode(text)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens])
