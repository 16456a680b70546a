"""Everything eldr imports is declared in pyproject.toml (dependencies or an extra)."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions, requires
from pathlib import Path

from stages.paths import REPO_ROOT

FIRST_PARTY = {"stages", "eldr_cli", "tests"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_top_level(root: Path) -> set[str]:
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_every_third_party_import_is_declared() -> None:
    declared = {
        _normalise(re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0]) for req in requires("eldr") or ()
    }
    distributions = packages_distributions()
    imported = set()
    for package in ("stages", "eldr_cli"):
        imported |= _imported_top_level(REPO_ROOT / package)
    third_party = imported - FIRST_PARTY - set(sys.stdlib_module_names) - {"__future__"}
    undeclared = {
        name for name in third_party
        if not any(_normalise(d) in declared for d in distributions.get(name, [name]))
    }
    assert not undeclared, f"imported but not declared in pyproject.toml: {sorted(undeclared)}"
