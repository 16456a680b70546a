"""Options shared by several commands, so they read the same everywhere."""

from __future__ import annotations

from typing import Annotated

import typer

ModelOption = Annotated[
    str,
    typer.Option(
        "--model", "-m",
        help="Preset (tiny, tiny-wide, mixtral, qwen3-moe, qwen2-moe, deepseek, gpt-oss, olmoe:"
        " see `eldr models`), a local Hugging Face directory, or a hub id.",
    ),
]
EagerOption = Annotated[
    bool,
    typer.Option(
        "--enforce-eager/--compiled",
        help="Run vLLM eagerly instead of in its default compiled mode (torch.compile, plus CUDA"
        " graphs on GPUs). eldr records in both; eager starts faster and decodes slower.",
    ),
]
SeedOption = Annotated[int, typer.Option("--seed", help="Random seed (results are reproducible).")]
