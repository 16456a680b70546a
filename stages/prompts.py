"""Benchmark prompts: a JSONL file of ``{"id", "prompt", "domain"}`` objects, one per line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from stages.errors import EldrError

REQUIRED_KEYS = ("id", "prompt", "domain")


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    domain: str


def load_prompts(path: Path) -> list[Prompt]:
    """Read every prompt; a malformed line is an error naming the file and line number.

    Blank lines are allowed (editors add them); duplicate ids are not, because results are
    joined back to prompts by id.
    """
    path = Path(path)
    if not path.is_file():
        raise EldrError(f"prompt file {path} does not exist")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise EldrError(f"{where}: not valid JSON ({exc})") from exc
            if not isinstance(obj, dict):
                raise EldrError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            missing = [key for key in REQUIRED_KEYS if key not in obj]
            if missing:
                raise EldrError(f"{where}: missing key(s) {', '.join(missing)}")
            values = {key: obj[key] for key in REQUIRED_KEYS}
            bad = [key for key, value in values.items() if not isinstance(value, str)]
            if bad:
                raise EldrError(f"{where}: {', '.join(bad)} must be string(s)")
            if not values["prompt"]:
                raise EldrError(f"{where}: empty prompt")
            if values["id"] in seen:
                raise EldrError(f"{where}: duplicate id {values['id']!r}")
            seen.add(values["id"])
            prompts.append(Prompt(**values))
    if not prompts:
        raise EldrError(f"{path} holds no prompts")
    return prompts


def sample_prompts(prompts: list[Prompt], num: int, seed: int) -> list[Prompt]:
    """``num`` prompts in a seeded random order; without replacement while the file suffices.

    Asking for more prompts than the file holds repeats whole shuffled passes (every prompt
    once before any twice) rather than failing, as ``vllm bench serve`` oversamples; repeats
    can hit the prefix cache, so the caller should prefer a large enough file.
    """
    if num < 1:
        raise EldrError(f"--num-prompts must be >= 1, got {num}")
    if not prompts:
        raise EldrError("no prompts to sample from")
    rng = np.random.default_rng(seed)
    passes = -(-num // len(prompts))
    order = np.concatenate([rng.permutation(len(prompts)) for _ in range(passes)])[:num]
    return [prompts[int(i)] for i in order]
