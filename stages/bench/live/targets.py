"""What a live bench drives: the eldr proxy under each of its policies (switched through its
admin API), or any OpenAI-compatible endpoint as one named router (driven as it is, no admin
calls: vllm-router, another proxy, a bare vLLM server)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stages.errors import EldrError


@dataclass(frozen=True)
class Target:
    name: str  # the row's name in the table and the results file
    url: str
    policy: str | None = None  # the eldr proxy's policy to switch to; None: as it is

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


def bench_targets(proxy_url: str, policies: Sequence[str], routers: Sequence[str]
                  ) -> tuple[Target, ...]:
    """The eldr proxy's ``policies`` first, then each ``--router``; names must be unique."""
    targets = [Target(p, proxy_url.rstrip("/"), p) for p in policies]
    targets += [parse_router(r) for r in routers]
    if not targets:
        raise EldrError("nothing to bench: give --policies and/or --router NAME=URL")
    names = [t.name for t in targets]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise EldrError(f"bench row named twice: {', '.join(twice)} (a --router's NAME must"
                        " differ from the policies')")
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
