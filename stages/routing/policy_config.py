"""Options per policy name, as ``--policy-config`` takes them: ``{"eldr-bl": {"epsilon": 0.3}}``.

Keyed by policy, so a policy's options survive switches to others and back (``eldr bench``
switches the proxy's policy through its admin API and sends no options). Only what the user
gave is kept; the rest is each policy's defaults, read when the policy is built. Every value is
checked when the config is made, so a bad one is refused before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import orjson

from stages.errors import EldrError
from stages.routing.policies import POLICIES, policy_params

Overrides = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class PolicyConfig:
    # (policy name, its (option, value) pairs), sorted: hashable, and equal when equal.
    entries: tuple[tuple[str, Overrides], ...] = ()

    def __post_init__(self) -> None:
        checked = {name: _checked(name, dict(pairs)) for name, pairs in self.entries}
        if len(checked) != len(self.entries):
            raise EldrError("a policy is listed twice in the policy config")
        object.__setattr__(self, "entries", tuple(sorted(checked.items())))

    @classmethod
    def from_mapping(cls, doc: object) -> PolicyConfig:
        """``{policy name: {option: value}}``, as decoded from JSON."""
        if not isinstance(doc, Mapping):
            raise EldrError(
                "the policy config must be a JSON object keyed by policy name, e.g."
                ' {"eldr-bl": {"epsilon": 0.3}}'
            )
        entries = []
        for name, options in doc.items():
            if not isinstance(options, Mapping):
                raise EldrError(
                    f"the options of policy {name!r} must be a JSON object, got {options!r}"
                )
            entries.append((name, tuple(options.items())))
        return cls(tuple(entries))

    @classmethod
    def from_json(cls, text: str) -> PolicyConfig:
        try:
            doc = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise EldrError(f"the policy config is not JSON ({exc}): {text!r}") from exc
        return cls.from_mapping(doc)

    def overrides(self, name: str) -> dict[str, Any]:
        """The options given for policy ``name`` (none: it runs on its defaults)."""
        return dict(dict(self.entries).get(name, ()))

    def updated(self, name: str, overrides: Mapping[str, Any]) -> PolicyConfig:
        """This config with ``overrides`` applied to policy ``name``'s options."""
        entries = dict(self.entries)
        entries[name] = tuple({**self.overrides(name), **overrides}.items())
        return PolicyConfig(tuple(entries.items()))

    def with_default(self, option: str, value: Any) -> PolicyConfig:
        """This config where every policy that has ``option`` and was not given it takes
        ``value``: a deployment's default (e.g. the cost preset of the workers' platform),
        below what the user said."""
        entries = dict(self.entries)
        for name, cls in POLICIES.items():
            if option in {f.name for f in fields(cls.Params)} and option not in dict(
                    entries.get(name, ())):
                entries[name] = (*entries.get(name, ()), (option, value))
        return PolicyConfig(tuple(entries.items()))

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {name: dict(pairs) for name, pairs in self.entries}


def _checked(name: str, overrides: dict[str, Any]) -> Overrides:
    """The overrides as the policy's dataclass stores them (an integer for a float is a
    float), after it accepted them."""
    params = policy_params(name, overrides)
    return tuple(sorted((key, getattr(params, key)) for key in overrides))
