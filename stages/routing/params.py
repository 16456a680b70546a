"""A policy's user options: the frozen dataclass it declares, built from a mapping of overrides.

Every surface that sets options (``eldr serve --policy-config``, ``POST /admin/policy``, the
simulator) goes through :func:`build_params`, which knows nothing of any policy: a field added
to a policy's dataclass is settable everywhere, with its type checked here and its range checked
in that dataclass's ``__post_init__``; its help (``option``) is what ``--help`` shows. Values
arrive as JSON scalars, so a field's type is one of ``float`` (an integer is accepted), ``int``,
``bool`` or ``str``.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from stages.errors import EldrError

P = TypeVar("P")

_TYPE_WORDS = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}


class ParamError(EldrError):
    """A refused option; ``param`` is its key, as the admin API's error names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class NoParams:
    """The options of a policy that has none (the load balancers)."""


def option(default: Any, help: str) -> Any:
    """A field of a policy's options with its one-line help."""
    return field(default=default, metadata={"help": help})


def option_help(cls: type) -> dict[str, str]:
    return {f.name: f.metadata.get("help", "") for f in fields(cls) if f.init}


def check_range(name: str, value: float, low: float, high: float = math.inf) -> None:
    """``value`` finite and in ``[low, high]``, else a :class:`ParamError` naming ``name``."""
    if not (math.isfinite(value) and low <= value <= high):
        upper = "" if math.isinf(high) else f" and <= {high:g}"
        raise ParamError(name, f"{name} must be a finite number >= {low:g}{upper}, got {value!r}")


def param_types(cls: type) -> dict[str, type]:
    """Each option of dataclass ``cls`` and its type (annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls) if f.init}


def build_params(cls: type[P], overrides: Mapping[str, Any], owner: str) -> P:
    """``cls`` with its defaults replaced by ``overrides``; ``owner`` (the policy name) goes
    into messages. Unknown keys and values of the wrong type are refused."""
    types = param_types(cls)
    unknown = sorted(set(overrides) - set(types))
    if unknown:
        valid = ", ".join(sorted(types)) or "none"
        raise ParamError(
            unknown[0], f"policy {owner!r} has no option {unknown[0]!r} (its options: {valid})"
        )
    values = {key: _typed(owner, key, types[key], value) for key, value in overrides.items()}
    try:
        return cls(**values)
    except ParamError as exc:
        raise ParamError(exc.param, f"policy {owner!r}: {exc}") from exc


def _typed(owner: str, key: str, kind: type, value: object) -> object:
    # bool is an int to Python; true for a number (or 1 for a flag) is a typo, not a value.
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind in (int, str, bool) and type(value) is kind:
        return value
    if kind not in _TYPE_WORDS:
        raise TypeError(f"option {key!r} of policy {owner!r} has type {kind}, not a JSON scalar")
    raise ParamError(
        key, f"policy {owner!r}: {key} must be {_TYPE_WORDS[kind]}, got {value!r}"
    )
