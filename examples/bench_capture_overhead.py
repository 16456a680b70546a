"""Prefill throughput with eldr's signature connector on and off, side by side in one run.

Two vLLM engines on the same model (one plain, one with the connector) take turns on the same
prompt batches (max_tokens=1, prefix caching off so every round really prefills), so machine
drift hits both alike. Prints each engine's prompt tokens/s per round and the median ratio
(goal: >= 0.97).

    .venv/bin/python examples/bench_capture_overhead.py --model tiny --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from stages.models import resolve_model
from stages.paths import EVALUATION_PROMPTS
from stages.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="prompts per round")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from stages.engine import kv_transfer_config

    model = resolve_model(args.model)
    common = dict(model=model.source, max_model_len=1024, max_num_seqs=8, dtype="bfloat16",
                  enforce_eager=True, enable_prefix_caching=False, seed=0,
                  gpu_memory_utilization=0.3)
    engines = {
        "off": LLM(**common),
        "on": LLM(**common, kv_transfer_config=KVTransferConfig(**kv_transfer_config("plain"))),
    }
    prompts = load_prompts(EVALUATION_PROMPTS)
    tokenizer = engines["off"].get_tokenizer()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds + 1):
        batch = prompts[r * args.batch : (r + 1) * args.batch]
        inputs = [{"prompt_token_ids": tokenizer.encode(p.prompt)[-1000:]} for p in batch]
        tokens = sum(len(i["prompt_token_ids"]) for i in inputs)
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for name in order:
            start = time.perf_counter()
            engines[name].generate(inputs, params, use_tqdm=False)
            rate = tokens / (time.perf_counter() - start)
            if r > 0:  # round 0 warms both engines up
                rates[name].append(rate)
        if r > 0:
            print(f"round {r}: off {rates['off'][-1]:8.0f} tok/s   on {rates['on'][-1]:8.0f}"
                  f" tok/s   ratio {rates['on'][-1] / rates['off'][-1]:.3f}")
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    print(f"median prefill throughput ratio (plugin on / off): {statistics.median(ratios):.3f}"
          f"  ({args.rounds} rounds x {args.batch} prompts, model {args.model})")


if __name__ == "__main__":
    main()
