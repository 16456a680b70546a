"""Every figure a bench reports, named once: its key in a policy's results, its label and unit,
and where it appears. The comparison table, its ratios to the best load balancer, the
rate-sweep plot and the replay's simulated-against-live checks all read ``METRICS``; adding a
reported metric is one entry here (a new quantity also needs the code that measures it, in
``metrics.summarize`` for client timings or the decode workers' counters).

Keys are ``vllm bench serve``'s where vLLM has the figure (``median_tpot_ms``...), so a
policy's results file keeps every key of vLLM's own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str  # "ms", "req/s", "tok/s", "requests" or "experts"
    column: bool = False  # a column of the comparison table
    over_best: bool = False  # also divided by the best load balancer's (the "/best" columns)
    rate_panel: bool = False  # a panel of the plot against request rate
    replayed: bool = False  # shown simulated against live by a replay
    tolerance: float | None = None  # relative: a replay judges it within this; None: shown
    spread_counts: bool = False  # the live run-to-run spread widens the tolerance

    @property
    def axis(self) -> str:
        return f"{self.label} ({self.unit})"


METRICS: tuple[Metric, ...] = (
    Metric("median_ttft_ms", "TTFT p50", "ms", column=True, replayed=True),
    Metric("p99_ttft_ms", "TTFT p99", "ms", column=True),
    Metric("median_tpot_ms", "TPOT p50", "ms", column=True, over_best=True, rate_panel=True,
           replayed=True, tolerance=0.10, spread_counts=True),
    Metric("p99_tpot_ms", "TPOT p99", "ms", column=True, over_best=True, rate_panel=True,
           replayed=True, tolerance=0.10, spread_counts=True),
    Metric("median_itl_ms", "ITL p50", "ms", column=True, replayed=True),
    Metric("p99_itl_ms", "ITL p99", "ms", column=True, replayed=True),
    Metric("median_e2el_ms", "E2EL p50", "ms", column=True),
    Metric("p99_e2el_ms", "E2EL p99", "ms", column=True),
    Metric("request_throughput", "req/s", "req/s", column=True),
    Metric("output_throughput", "tok/s", "tok/s", column=True),
    Metric("failed", "fail", "requests", column=True),
    # Distinct experts per MoE layer a decode step read: the decode workers' counters live,
    # the simulated steps in a simulation.
    Metric("distinct_experts_per_layer", "experts/L", "experts", column=True, rate_panel=True,
           replayed=True, tolerance=0.05),
)

COLUMNS = tuple(m for m in METRICS if m.column)
OVER_BEST = tuple(m for m in METRICS if m.over_best)
RATE_PANELS = tuple(m for m in METRICS if m.rate_panel)
REPLAYED = tuple(m for m in METRICS if m.replayed)

# Traffic with history (``eldr bench --workload conversations|sharegpt``, live or simulated):
# its own table, since a single-turn bench has none of these.
CONVERSATION_METRICS: tuple[Metric, ...] = (
    Metric("median_ttft_turn1_ms", "TTFT p50 t1", "ms"),
    Metric("p99_ttft_turn1_ms", "TTFT p99 t1", "ms"),
    Metric("median_ttft_later_ms", "TTFT p50 t>=2", "ms"),
    Metric("p99_ttft_later_ms", "TTFT p99 t>=2", "ms"),
    Metric("ttft_later_round_spread_ms", "t>=2 p50 spread", "ms"),
    Metric("median_tpot_ms", "TPOT p50", "ms"),
    Metric("p99_tpot_ms", "TPOT p99", "ms"),
    Metric("tpot_round_spread_ms", "TPOT p50 spread", "ms"),
    # Prefill workers' own vllm:prefix_cache_hits / _queries over the runs (simulated: their
    # modelled caches), the ideal of the workload (every turn on the worker holding its
    # history; a PD prefill worker holds prompts, not answers), and the share of that ideal.
    Metric("prefill_hit_share", "P hit", "share"),
    Metric("ideal_prefill_hit_share", "P ideal", "share"),
    Metric("prefill_hit_of_ideal", "P/ideal", "share"),
    # Prompt tokens the decode workers pulled over the KV connector (vLLM's
    # prompt_tokens_by_source{source="external_kv_transfer"}), and what their own cache held.
    Metric("decode_kv_pulled_tokens", "D pulled", "tokens"),
    Metric("decode_hit_share", "D hit", "share"),
    # Prompt tokens a decode worker prefilled itself (eldr-kv's conditional disaggregation):
    # they reach no prefill worker, so "P hit" leaves them out.
    Metric("local_prefill_share", "local", "share"),
    Metric("failed", "fail", "requests"),
)

# Where a live router's mean TTFT goes, from the workers' own histograms
# (``live.engine_latency``): the prefill engines' whole request, the decode engines' time to
# first token (and the part of it queued: the KV pull's wait), and the rest (router, HTTP).
TTFT_PARTS: tuple[Metric, ...] = (
    Metric("mean_ttft_ms", "TTFT mean", "ms"),
    Metric("prefill_engine_ms", "P engine", "ms"),
    Metric("decode_engine_ttft_ms", "D engine TTFT", "ms"),
    Metric("decode_engine_queue_ms", "of it queued", "ms"),
    Metric("ttft_outside_engines_ms", "outside engines", "ms"),
)
# The simulator's own split of later turns' TTFT (PD path, means: the parts add up).
SIM_TTFT_PARTS: tuple[Metric, ...] = (
    Metric("sim_ttft_later_pd_ms", "TTFT mean t>=2", "ms"),
    Metric("sim_ttft_prefill_ms", "prefill (queue + compute)", "ms"),
    Metric("sim_ttft_pull_ms", "KV pull", "ms"),
    Metric("sim_ttft_first_step_ms", "first decode step (wait + own)", "ms"),
)
