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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httpx

from stages.bench.live.prometheus_text import increases, samples, summed
from stages.bench.live.worker_metrics import scrape_metrics_pages

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
        """``self - before``, counter by counter (``increase``: a restart in between counts
        what was counted since)."""
        return increases(before, self)


def _is(name: str, stem: str) -> bool:
    return name in (stem, stem + "_total")


def cache_counters(text: str) -> CacheCounters:
    """A worker's counters from its ``/metrics`` page."""
    sums: dict[str, float] = {}
    for name, labels, value in samples(text):
        for key, stem, source in ((QUERIES, QUERIES, None), (HITS, HITS, None),
                                  (EXTERNAL, BY_SOURCE, EXTERNAL),
                                  (LOCAL_HIT, BY_SOURCE, LOCAL_HIT),
                                  (COMPUTED, BY_SOURCE, COMPUTED)):
            if _is(name, stem) and (source is None or labels.get("source") == source):
                sums[key] = sums.get(key, 0.0) + value
    return CacheCounters(sums.get(QUERIES, _NAN), sums.get(HITS, _NAN), sums.get(EXTERNAL, _NAN),
                         sums.get(LOCAL_HIT, _NAN), sums.get(COMPUTED, _NAN))


def deltas(before: Mapping[str, CacheCounters], after: Mapping[str, CacheCounters]
           ) -> dict[str, CacheCounters]:
    return {url: after[url].minus(b) for url, b in before.items()}


def total(counters: Iterable[CacheCounters]) -> CacheCounters:
    return summed(counters, CacheCounters())


def block_size_of(text: str) -> int | None:
    """The KV block size a worker reports in ``vllm:cache_config_info{block_size=...}``."""
    for name, labels, _ in samples(text):
        if name == "vllm:cache_config_info" and labels.get("block_size", "").isdigit():
            return int(labels["block_size"])
    return None


async def worker_block_size(client: httpx.AsyncClient, url: str) -> int | None:
    pages = await scrape_metrics_pages(client, [url])
    return block_size_of(pages[url])
