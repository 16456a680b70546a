"""The written order of the stages holds (pyproject.toml, ``[tool.importlinter]``): no module
imports from a stage above its own, and no two parts of a package import each other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_the_stages_keep_their_written_order_and_import_no_cycle() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_no_package_is_left_out_of_the_cycle_contract() -> None:
    # The proxy was once skipped while its subsystems imported each other both ways.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    acyclic = [c for c in config["contracts"] if c["type"] == "acyclic_siblings"]
    assert acyclic and all(not c.get("skip_descendants") for c in acyclic), acyclic
