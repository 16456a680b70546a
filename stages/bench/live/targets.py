"""What a live bench drives: the eldr proxy under each of its policies (switched through its
admin API), a labelled variant of one of them (its own options, ``--variant``), or any
OpenAI-compatible endpoint as one named router (driven as it is, no admin calls: vllm-router,
another proxy, a bare vLLM server)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from stages.errors import EldrError
from stages.routing.policies import POLICIES, policy_params
from stages.routing.policy_config import PolicyConfig

Options = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Target:
    name: str  # the row's name in the table and the results file
    url: str
    policy: str | None = None  # the eldr proxy's policy to switch to; None: as it is
    # The options sent with the switch; None: --policy-config's for the policy. The proxy keeps
    # a policy's options across switches, so a row beside a variant of its policy sends every
    # option a variant changes.
    options: Options | None = None

    @property
    def switches_policy(self) -> bool:
        return self.policy is not None


def parse_router(text: str) -> Target:
    """``NAME=URL`` (``--router``)."""
    name, sep, url = text.partition("=")
    name, url = name.strip(), url.strip()
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise EldrError(f"--router takes NAME=URL (e.g. vllm-router=http://127.0.0.1:8090),"
                        f" got {text!r}")
    return Target(name, url.rstrip("/"))


@dataclass(frozen=True)
class Variant:
    label: str
    policy: str
    options: Options  # as the policy's dataclass stores them


def parse_variant(text: str) -> Variant:
    """``LABEL=POLICY:JSON`` (``--variant``), e.g. ``arrival=eldr-kv:{"decode_choice":
    "arrival"}``; the options are checked as ``--policy-config``'s are."""
    label, sep, rest = text.partition("=")
    policy, colon, doc = rest.partition(":")
    label, policy = label.strip(), policy.strip()
    if not sep or not colon or not label or not policy:
        raise EldrError(f"--variant takes LABEL=POLICY:JSON (e.g."
                        f" 'arrival=eldr-kv:{{\"decode_choice\": \"arrival\"}}'), got {text!r}")
    if policy not in POLICIES:
        raise EldrError(f"--variant {label}: unknown policy {policy!r}; choose from"
                        f" {', '.join(POLICIES)}")
    try:
        options = orjson.loads(doc)
    except orjson.JSONDecodeError as exc:
        raise EldrError(f"--variant {label}: the options are not JSON ({exc}): {doc!r}") from exc
    try:
        checked = PolicyConfig.from_mapping({policy: options})
    except EldrError as exc:
        raise EldrError(f"--variant {label}: {exc}") from exc
    return Variant(label, policy, tuple(checked.overrides(policy).items()))


def _policy_rows(proxy_url: str, policies: Sequence[str], variants: Sequence[Variant],
                 config: PolicyConfig) -> list[Target]:
    """The plain policies, then the variants. Every row of a policy a variant changes sends
    the policy's defaults for the options any of its variants sets, under --policy-config's
    and its own: whichever ran before, each row runs with exactly its options."""
    url = proxy_url.rstrip("/")
    varied: dict[str, set[str]] = {}
    for v in variants:
        varied.setdefault(v.policy, set()).update(key for key, _ in v.options)

    def options(policy: str, own: Options) -> Options | None:
        if policy not in varied:
            return None
        defaults = asdict(policy_params(policy))
        reset = {key: defaults[key] for key in sorted(varied[policy])}
        return tuple({**reset, **config.overrides(policy), **dict(own)}.items())

    rows = [Target(p, url, p, options(p, ())) for p in policies]
    return rows + [Target(v.label, url, v.policy, options(v.policy, v.options))
                   for v in variants]


def bench_targets(proxy_url: str, policies: Sequence[str], routers: Sequence[str],
                  variants: Sequence[Variant] = (), config: PolicyConfig | None = None
                  ) -> tuple[Target, ...]:
    """The eldr proxy's ``policies`` first, then its ``variants``, then each ``--router``;
    names must be unique."""
    targets = _policy_rows(proxy_url, policies, variants, config or PolicyConfig())
    targets += [parse_router(r) for r in routers]
    if not targets:
        raise EldrError("nothing to bench: give --policies, --variant and/or --router NAME=URL")
    names = [t.name for t in targets]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise EldrError(f"bench row named twice: {', '.join(twice)} (a --router's NAME and a"
                        " --variant's LABEL must differ from the policies' and each other's)")
    return tuple(targets)


def parse_urls(text: str | None) -> tuple[str, ...] | None:
    """``URL,URL`` (``--prefill-urls``, ``--decode-urls``); None when not given."""
    if text is None:
        return None
    urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise EldrError(f"not a worker URL: {bad[0]!r} (expected http://HOST:PORT)")
    return urls
