"""Engine throughput with eldr's recording on and off, side by side in one run.

The yardstick is plain vLLM in its default mode (compiled; on GPUs also CUDA graphs). Three
engines on the same model take turns on the same request batches (prefill plus decode, fresh
prompts every round so prefix caching never skips the work), so machine drift hits all alike:

- ``plain``: vLLM's defaults, no eldr connector;
- ``plain-again``: the same engine a second time, the control: how far two identical engines
  drift apart on this machine, i.e. the smallest difference this run can resolve;
- ``eldr``: the same defaults with eldr's connector (what ``eldr serve`` runs now);
- ``eldr-eager``: eldr's connector with ``enforce_eager`` (what eldr forced before).

Prints each engine's output tokens/s per round, its median, and the ratios to ``plain`` (goal
for ``eldr``: >= 0.95, read against the control's ratio).

    .venv/bin/python examples/bench_capture_overhead.py --model tiny --rounds 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from stages.models import resolve_model
from stages.paths import EVALUATION_PROMPTS
from stages.prompts import load_prompts

ENGINES = ("plain", "plain-again", "eldr", "eldr-eager")


def build_engines(source: str, max_num_seqs: int) -> dict[str, Any]:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from stages.engine import kv_transfer_config, on_cpu

    common: dict[str, Any] = dict(
        model=source, max_model_len=1024, max_num_seqs=max_num_seqs, seed=0,
        gpu_memory_utilization=0.25,
    )
    if on_cpu():
        common["dtype"] = "bfloat16"
    eldr = KVTransferConfig(**kv_transfer_config("plain"))
    return {
        "plain": LLM(**common),
        "plain-again": LLM(**common),
        "eldr": LLM(**common, kv_transfer_config=eldr),
        "eldr-eager": LLM(**common, kv_transfer_config=eldr, enforce_eager=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds of quiet before each timed batch")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import SamplingParams

    model = resolve_model(args.model)
    started = time.perf_counter()
    engines = build_engines(model.source, max_num_seqs=args.batch)
    print(f"{len(engines)} engines ready in {time.perf_counter() - started:.0f} s")
    prompts = load_prompts(EVALUATION_PROMPTS)
    tokenizer = engines["plain"].get_tokenizer()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in ENGINES}
    for r in range(args.rounds + 1):
        batch = prompts[r * args.batch : (r + 1) * args.batch]
        inputs = [{"prompt_token_ids": tokenizer.encode(p.prompt)[-512:]} for p in batch]
        # Rotate the order so no engine always runs first (or right after another's load).
        order = ENGINES[r % len(ENGINES):] + ENGINES[: r % len(ENGINES)]
        for name in order:
            # The engine that just ran keeps its OpenMP threads spinning for a while; let them
            # park so they do not steal this engine's cores.
            time.sleep(args.settle)
            start = time.perf_counter()
            outputs = engines[name].generate(inputs, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            if r > 0:  # round 0 warms every engine up
                rates[name].append(tokens / elapsed)
        if r > 0:
            cells = "   ".join(f"{name} {rates[name][-1]:7.0f}" for name in ENGINES)
            print(f"round {r}: output tok/s   {cells}")
    plain = statistics.median(rates["plain"])
    for name in ENGINES:
        median = statistics.median(rates[name])
        print(f"{name:>11}: median {median:7.0f} output tok/s  ({median / plain:.3f} x plain)")
    for name in ENGINES[1:]:
        ratios = [a / b for a, b in zip(rates[name], rates["plain"], strict=True)]
        print(f"median throughput ratio {name} / plain (default mode): "
              f"{statistics.median(ratios):.3f}   (rounds: "
              + ", ".join(f"{x:.3f}" for x in ratios) + ")")
    print(f"{args.rounds} rounds x {args.batch} requests x {args.max_tokens} output tokens,"
          f" model {args.model}")


if __name__ == "__main__":
    main()
