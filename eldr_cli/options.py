"""Options shared by several commands, so they read the same everywhere."""

from __future__ import annotations

from typing import Annotated

import typer

ModelOption = Annotated[
    str,
    typer.Option(
        "--model", "-m",
        help="Preset (tiny, tiny-wide, mixtral, qwen3-moe, gpt-oss, olmoe), a local Hugging"
        " Face directory, or a hub id.",
    ),
]
SeedOption = Annotated[int, typer.Option("--seed", help="Random seed (results are reproducible).")]
