"""Where eldr keeps things by default, so the card's bare invocations work.

Everything lives under one home folder (``$ELDR_HOME``, else ``./.eldr``) so that
``eldr capture`` and ``eldr fit --k 20 --balanced`` meet on the same dataset without flags.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = REPO_ROOT / "examples"
BUNDLED_MODELS_DIR = EXAMPLES_DIR / "models"
PROMPTS_DIR = EXAMPLES_DIR / "prompts"
CALIBRATION_PROMPTS = PROMPTS_DIR / "calibration.jsonl"
EVALUATION_PROMPTS = PROMPTS_DIR / "evaluation.jsonl"

DEFAULT_PROXY_URL = "http://127.0.0.1:8000"


def eldr_home() -> Path:
    return Path(os.environ.get("ELDR_HOME", ".eldr")).resolve()


def default_dataset() -> Path:
    return eldr_home() / "signatures.zarr"


def default_traffic_dataset() -> Path:
    """Where `eldr serve --record` appends the requests it routed."""
    return eldr_home() / "traffic.zarr"


def default_artifact_store() -> Path:
    return eldr_home() / "artifacts"


def derived_models_dir() -> Path:
    """Models derived at first use (e.g. the widened memory-bound variant)."""
    return eldr_home() / "models"


def default_result_dir() -> Path:
    return eldr_home() / "results"
