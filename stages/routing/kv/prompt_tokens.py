"""A request's prompt as the token ids its worker will run, for matching KV blocks.

vLLM tokenizes a completion's text prompt with the model's tokenizer, special tokens added
unless the request says ``add_special_tokens: false``; a chat request's messages go through the
model's chat template with the generation prompt added and are tokenized by it
(``apply_chat_template(tokenize=True)``, no special tokens added beyond the template's). A
request this cannot reproduce exactly (images, tools, a template or template options of its
own, a LoRA adapter) gets ``None``: it is routed without KV matching rather than on a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from stages.errors import EldrError
from stages.routing.kv.segment_cache import SegmentCache

# Chat fields that change the rendered prompt in ways only vLLM's own renderer reproduces.
_CHAT_UNSUPPORTED = ("tools", "chat_template", "chat_template_kwargs", "documents",
                     "continue_final_message", "mm_processor_kwargs")


_BACKEND_SAMPLES = ("plain words", " spaced  out\n\nlines ", "digits 12345, ünïcödé, 漢字")


class PromptTokenizer:
    def __init__(self, model: str) -> None:
        """``model``: what the workers were given as ``--model`` (a directory or hub id)."""
        try:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError) as exc:
            raise EldrError(f"cannot load the tokenizer of {model!r} for KV-aware routing:"
                            f" {exc}") from None
        self.model = model
        # vLLM checks a prompt against --max-model-len itself; the tokenizer's own limit would
        # only log a warning per long prompt here.
        self._tok.model_max_length = 1 << 62
        self._specials = _added_specials(self._tok)
        # A fast tokenizer's Rust half, where it encodes as the tokenizer does (checked).
        backend = getattr(self._tok, "backend_tokenizer", None)
        self._backend = backend if backend is not None and all(
            backend.encode(t, add_special_tokens=False).ids
            == list(self._tok.encode(t, add_special_tokens=False)) for t in _BACKEND_SAMPLES
        ) else None
        self._pieces = SegmentCache(self._tok, backend=self._backend)

    @property
    def backend(self) -> Any | None:
        """The Rust tokenizer, where it encodes as the tokenizer does; else None."""
        return self._backend

    @property
    def reuses_pieces(self) -> bool:
        """Whether chat prompts are encoded by pieces kept from earlier ones (off for good
        once a check found it wrong)."""
        return self._pieces.enabled

    @property
    def head_specials(self) -> list[int]:
        """The ids the tokenizer adds before every completion prompt's text (a BOS)."""
        return [] if self._specials is None else self._specials[0]

    def completion(self, body: dict[str, Any]) -> list[int] | None:
        return self.ids(self.render(body, chat=False))

    def chat(self, body: dict[str, Any]) -> list[int] | None:
        return self.ids(self.render(body, chat=True))

    def render(self, body: dict[str, Any], chat: bool) -> Rendered | None:
        """The request's prompt as the text its worker encodes (or the ids it was given);
        None where it cannot be reproduced exactly."""
        return self._chat(body) if chat else self._completion(body)

    def ids(self, rendered: Rendered | None) -> list[int] | None:
        """All of the prompt's ids."""
        if rendered is None:
            return None
        if rendered.text is None:
            return list(rendered.before)
        if rendered.whole:
            return list(self._tok.encode(rendered.text, add_special_tokens=True))
        # Ids from the tokenizer itself need no per-token check (150 us at 2,000 tokens).
        ids = [*rendered.before, *self._pieces.encode(rendered.text), *rendered.after]
        return ids or None

    def head_ids(self, rendered: Rendered, chars: int) -> list[int]:
        """The ids of the prompt's first ``chars`` characters, encoded apart (nothing cached):
        all but the last few equal the whole prompt's first ids, as a tokenizer that splits
        its text into words first encodes each word on its own."""
        if rendered.text is None:
            return list(rendered.before)
        text = rendered.text[:chars]
        if rendered.whole:
            return list(self._tok.encode(text, add_special_tokens=True))
        if self._backend is not None:  # the Rust tokenizer itself: half the wrapper's time
            return [*rendered.before, *self._backend.encode(text, add_special_tokens=False).ids]
        return [*rendered.before, *self._tok.encode(text, add_special_tokens=False)]

    def _completion(self, body: dict[str, Any]) -> Rendered | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # one prompt in a list is the same request
        if isinstance(prompt, str):
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                return None
            if not special:
                return Rendered(prompt)
            if self._specials is None:
                return Rendered(prompt, whole=True)
            head, tail = self._specials
            return Rendered(prompt, tuple(head), tuple(tail))
        if _token_ids(prompt):
            return Rendered(None, tuple(prompt))
        return None

    def _chat(self, body: dict[str, Any]) -> Rendered | None:
        if any(body.get(name) not in (None, False, []) for name in _CHAT_UNSUPPORTED):
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        conversation = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return None
            content = _text(message.get("content"))
            if content is None or set(message) - {"role", "content", "name"}:
                return None
            conversation.append({**message, "content": content})
        generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(generation_prompt, bool) or body.get("add_special_tokens"):
            return None
        from jinja2 import TemplateError

        try:
            # Rendered, then encoded with no special tokens added: what tokenize=True does,
            # here by pieces so a conversation's history is not encoded again each turn.
            text = self._tok.apply_chat_template(
                conversation, add_generation_prompt=generation_prompt, tokenize=False)
        except (TemplateError, ValueError):
            return None  # the template refuses this input: the worker will answer why
        if not isinstance(text, str) or not text:
            return None
        return Rendered(text)


class Rendered(NamedTuple):
    text: str | None  # what the worker encodes; None: the request gave token ids
    before: tuple[int, ...] = ()  # ids added before the text's (the given ids, if no text)
    after: tuple[int, ...] = ()  # ids added after them
    whole: bool = False  # the tokenizer adds specials of its own making: encode it whole


def _added_specials(tok: Any) -> tuple[list[int], list[int]] | None:
    """The ids ``add_special_tokens=True`` puts before and after a text's own (e.g. a BOS),
    where the tokenizer adds the same ones to every text; None where it does not."""
    bare = list(tok.encode("x", add_special_tokens=False))
    full = list(tok.encode("x", add_special_tokens=True))
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            head, tail = full[:start], full[start + len(bare):]
            break
    else:
        return None
    for text in ("some words", " spaced out ", "1 2 3\n"):
        if list(tok.encode(text, add_special_tokens=True)) != [
                *head, *tok.encode(text, add_special_tokens=False), *tail]:
            return None
    return head, tail


def _token_ids(value: object) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str | bytes) and len(value) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _text(content: object) -> str | None:
    """Message content as vLLM's string content format renders it: text parts joined by a
    newline; any other part (an image, audio) is not reproduced here."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            return None
        parts.append(part["text"])
    return "\n".join(parts)
