"""The proxy stays readable: a request's path in six files read top to bottom, one HTTP client,
no import cycles inside it."""

from __future__ import annotations

import ast
from pathlib import Path

from stages.paths import REPO_ROOT
from tests.path_walk import walk_one_request

PROXY = REPO_ROOT / "stages" / "serve" / "proxy"
MAX_FILES_ON_PATH = 6


def test_a_request_reaches_the_worker_socket_through_six_files_without_turning_back() -> None:
    walk, status = walk_one_request("eldr-kv")
    assert status == 200 and walk.done
    assert len(walk.files) <= MAX_FILES_ON_PATH, walk.files
    assert walk.files[0].endswith("front/completions.py")
    assert walk.files[-1].endswith("client/http1.py")
    assert walk.returns == [], walk.returns


def _module(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (functions, TYPE_CHECKING blocks too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_import_cycle_inside_the_proxy() -> None:
    files = {_module(p): p for p in PROXY.rglob("*.py")}
    package = _module(PROXY / "__init__.py")  # re-exports the app: every module is below it
    graph = {
        name: {m for m in _imports(path) if m in files and m not in (name, package)}
        for name, path in files.items()
    }
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            cycle = [*stack[stack.index(name):], name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_every_worker_and_peer_call_goes_through_the_one_client() -> None:
    serve = REPO_ROOT / "stages" / "serve"
    others = {
        str(p.relative_to(REPO_ROOT)): sorted(
            m for m in _imports(p) if m.split(".")[0] in ("aiohttp", "httpx", "requests"))
        for p in serve.rglob("*.py")
    }
    assert {p: m for p, m in others.items() if m} == {}
