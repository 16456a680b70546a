"""The token ids each row of a signature dataset was prefilled with, for the token predictor.

A capture stores no prompt text, only each prompt's id and sha256; a store recorded with
prompts (`eldr serve --record`) keeps the text in its ``prompt`` column. A row's text is that
column's where present, else the prompt of the same id in the bundled prompt files, kept only
where its sha256 is the row's (an edited prompt file must not lend another text). The text is
tokenised by the model's own tokenizer and cut to the row's last ``prompt_tokens`` tokens, as
`eldr capture` cuts an over-long prompt; a tokenizer that yields fewer tokens than were
prefilled is not the one the capture ran with, and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages import paths
from stages.errors import EldrError
from stages.prompts import load_prompts
from stages.signature.dataset import SignatureArrays, prompt_digest

Encode = Callable[[str], Sequence[int]]
PROMPT_FILES = (paths.CALIBRATION_PROMPTS, paths.EVALUATION_PROMPTS)


@dataclass(frozen=True)
class PromptTokens:
    """Every row's token ids, or why they are not known (``tokens`` None)."""

    tokens: list[np.ndarray] | None
    missing: str = ""


def prompt_texts(
    arrays: SignatureArrays, recorded: np.ndarray, prompt_files: Sequence[Path] = PROMPT_FILES
) -> list[str | None]:
    """Each row's prompt text, None where neither the row nor a prompt file has it."""
    by_id: dict[str, str] = {}
    for path in prompt_files:
        if Path(path).is_file():
            by_id.update({p.id: p.prompt for p in load_prompts(path)})
    texts: list[str | None] = []
    for row_id, digest, text in zip(arrays.ids, arrays.prompt_sha256, recorded, strict=True):
        candidate = str(text) if text else by_id.get(str(row_id))
        texts.append(candidate if candidate is not None and digest and
                     prompt_digest(candidate) == digest else None)
    return texts


def prompt_tokens(
    arrays: SignatureArrays, texts: Sequence[str | None], load_encoder: Callable[[], Encode]
) -> PromptTokens:
    """Every row's prefilled token ids from its text (``prompt_texts``), by the tokenizer
    ``load_encoder`` gives (loaded only when every text is known)."""
    unknown = sum(text is None for text in texts)
    if unknown:
        return PromptTokens(None, f"{unknown} of {len(texts)} requests have no prompt text"
                            " (neither recorded with the dataset nor in the bundled prompt"
                            " files with the same sha256)")
    try:
        encode = load_encoder()
    except EldrError as exc:
        return PromptTokens(None, str(exc))
    tokens = []
    for text, row_id, length in zip(texts, arrays.ids, arrays.prompt_tokens, strict=True):
        ids = np.asarray(encode(str(text)), dtype=np.int64)
        if len(ids) < int(length):
            return PromptTokens(None, f"the tokenizer makes {len(ids)} tokens of request"
                                f" {row_id!s}, which was prefilled with {int(length)}: not the"
                                " tokenizer the capture ran with")
        tokens.append(ids[len(ids) - int(length):])
    return PromptTokens(tokens)


def model_encoder(model_name: str) -> Encode:
    """The tokenizer vLLM loads for the model the dataset names (its ``encode``, special
    tokens added as vLLM adds them)."""
    from stages.models import resolve_model

    source = resolve_model(model_name).source
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise EldrError(f"cannot load the tokenizer of {model_name} ({source}): {exc}") from exc
    return tokenizer.encode
