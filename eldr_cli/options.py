"""Options shared by several commands, so they read the same everywhere."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer

from stages.errors import EldrError
from stages.routing.params import option_help
from stages.routing.policies import POLICIES, policy_params
from stages.routing.policy_config import PolicyConfig

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



def _policy_options() -> str:
    # From the registry, so a new option is documented where it is declared.
    described = []
    for name, cls in POLICIES.items():
        defaults, helps = asdict(policy_params(name)), option_help(cls.Params)
        described += [f"{name} {key}={value} ({helps[key]})" for key, value in defaults.items()]
    return "; ".join(described)


PolicyConfigOption = Annotated[
    str | None,
    typer.Option(
        "--policy-config",
        help="Options per policy, as JSON keyed by policy name, e.g. '{\"eldr-bl\": {\"epsilon\":"
        " 0.3}, \"eldr\": {\"tau\": 0.05}}'; each applies whenever that policy runs. Options,"
        f" with their defaults: {_policy_options()}.",
        show_default=False,
    ),
]


def policy_config(text: str | None) -> PolicyConfig:
    """``--policy-config`` checked in full (every policy it names), before anything starts."""
    if text is None:
        return PolicyConfig()
    try:
        return PolicyConfig.from_json(text)
    except EldrError as exc:
        raise EldrError(f"--policy-config: {exc}") from exc
