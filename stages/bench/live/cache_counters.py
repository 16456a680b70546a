"""Each worker's own prefix-cache and KV-transfer counters, read from its ``/metrics``.

vLLM 0.32 (``vllm/v1/metrics/loggers.py``) exports, per engine:

- ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: prompt tokens looked
  up in the local prefix cache, and those found (whole blocks);
- ``vllm:prompt_tokens_by_source_total{source=...}``: prompt tokens by where their KV came
  from, ``local_compute``, ``local_cache_hit`` or ``external_kv_transfer`` (pulled over the KV
  connector: on a PD decode worker, the tokens NIXL moved from the prefill worker).

Label sets other than ``source`` (engine, model) are summed. A worker without a counter reads
as NaN, never 0: a missing figure must not pass for a perfect one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httpx

from stages.bench.live.worker_metrics import metrics_url, scrape_metrics_pages
from stages.errors import EldrError

QUERIES = "vllm:prefix_cache_queries"
HITS = "vllm:prefix_cache_hits"
BY_SOURCE = "vllm:prompt_tokens_by_source"
EXTERNAL = "external_kv_transfer"
LOCAL_HIT = "local_cache_hit"
COMPUTED = "local_compute"

_NAN = float("nan")


@dataclass(frozen=True)
class CacheCounters:
    """Cumulative values of one worker (or a delta between two scrapes)."""

    queries: float = _NAN
    hits: float = _NAN
    external_tokens: float = _NAN  # prompt tokens pulled over the KV connector
    local_hit_tokens: float = _NAN
    computed_tokens: float = _NAN

    @property
    def hit_share(self) -> float:
        return self.hits / self.queries if self.queries > 0 else _NAN

    def minus(self, before: CacheCounters) -> CacheCounters:
        """``self - before``; a counter that went down means a restart in between, and then
        (as Prometheus' ``increase``) what it counted since is the delta."""

        def delta(b: float, a: float) -> float:
            if math.isnan(a) or math.isnan(b):
                return _NAN
            return a - b if a >= b else a

        return CacheCounters(*(delta(getattr(before, f), getattr(self, f)) for f in (
            "queries", "hits", "external_tokens", "local_hit_tokens", "computed_tokens")))


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.index("=", i)
        key = text[i:eq].strip().lstrip(",").strip()
        if text[eq + 1] != '"':
            raise ValueError(f"unquoted label value in {{{text}}}")
        j, value = eq + 2, []
        while text[j] != '"':
            if text[j] == "\\":
                j += 1
            value.append(text[j])
            j += 1
        out[key] = "".join(value)
        i = j + 1
        while i < len(text) and text[i] in ", ":
            i += 1
    return out


def _samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if "{" in line.split(" ", 1)[0]:
                name, rest = line.split("{", 1)
                close = rest.rindex("}")
                labels, value = _labels(rest[:close]), rest[close + 1 :].split()[0]
            else:
                name, value = line.split()[:2]
                labels = {}
            yield name, labels, float(value)
        except (ValueError, IndexError) as exc:
            raise EldrError(f"line {lineno} of a /metrics page is not Prometheus text:"
                            f" {exc}") from exc


def _is(name: str, stem: str) -> bool:
    return name in (stem, stem + "_total")


def cache_counters(text: str) -> CacheCounters:
    """A worker's counters from its ``/metrics`` page."""
    sums: dict[str, float] = {}
    for name, labels, value in _samples(text):
        for key, stem, source in ((QUERIES, QUERIES, None), (HITS, HITS, None),
                                  (EXTERNAL, BY_SOURCE, EXTERNAL),
                                  (LOCAL_HIT, BY_SOURCE, LOCAL_HIT),
                                  (COMPUTED, BY_SOURCE, COMPUTED)):
            if _is(name, stem) and (source is None or labels.get("source") == source):
                sums[key] = sums.get(key, 0.0) + value
    return CacheCounters(sums.get(QUERIES, _NAN), sums.get(HITS, _NAN), sums.get(EXTERNAL, _NAN),
                         sums.get(LOCAL_HIT, _NAN), sums.get(COMPUTED, _NAN))


async def scrape_cache_counters(client: httpx.AsyncClient, worker_urls: Iterable[str],
                                timeout_s: float = 10.0) -> dict[str, CacheCounters]:
    """One scrape of every worker's cache counters (``scrape_metrics_pages``)."""
    pages = await scrape_metrics_pages(client, worker_urls, timeout_s)
    return {url: cache_counters(text) for url, text in pages.items()}


def deltas(before: Mapping[str, CacheCounters], after: Mapping[str, CacheCounters]
           ) -> dict[str, CacheCounters]:
    return {url: after[url].minus(b) for url, b in before.items()}


def total(counters: Iterable[CacheCounters]) -> CacheCounters:
    fields = ("queries", "hits", "external_tokens", "local_hit_tokens", "computed_tokens")
    items = list(counters)
    return CacheCounters(*(sum(getattr(c, f) for c in items) if items else _NAN
                           for f in fields))


def block_size_of(text: str) -> int | None:
    """The KV block size a worker reports in ``vllm:cache_config_info{block_size=...}``."""
    for name, labels, _ in _samples(text):
        if name == "vllm:cache_config_info" and labels.get("block_size", "").isdigit():
            return int(labels["block_size"])
    return None


async def worker_block_size(client: httpx.AsyncClient, url: str) -> int | None:
    try:
        response = await client.get(metrics_url(url), timeout=10.0)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise EldrError(f"cannot read {metrics_url(url)}: {exc}") from exc
    return block_size_of(response.text)
