"""Engine throughput with eldr's recording on and off, side by side in one run.

The yardstick is plain vLLM in its default mode (compiled; on GPUs also CUDA graphs). Four
engines on the same model take turns on the same request batches (prefill plus decode, fresh
prompts every round so prefix caching never skips the work), so machine drift hits all alike:

- ``plain``: vLLM's defaults, no eldr connector;
- ``plain-again``: the same engine a second time, the control: how far two identical engines
  drift apart on this machine, i.e. the smallest difference this run can resolve;
- ``eldr``: the same defaults with eldr's connector (what ``eldr serve`` runs now);
- ``eldr-eager``: eldr's connector with ``enforce_eager`` (what eldr forced before).

Two figures per engine and round, from the same timed batch:

- output tokens per wall-clock second: the user's figure, but on a shared 2-core machine one
  round swings 2x with whatever else runs;
- CPU milliseconds per output token: the work the engine does per token. On the CPU build each
  engine runs in its own process with scheduler, worker and model in one thread (vLLM's
  uniprocess executor, one OpenMP thread), so nothing in it spins while waiting and another
  process taking the core delays a round without adding CPU time to it. That resolves a few
  percent where wall time cannot; and since the engine is that one thread, the inverse ratio of
  the work is the throughput ratio to expect on a quiet core. On GPUs the ratio of work says
  less (the device runs the model), so read the wall-clock column there.

For each: the median over rounds of the paired ratio to ``plain``, with a bootstrap 95%
interval (goal for ``eldr``: >= 0.95, read against the control's ratio).

    .venv/bin/python examples/bench_capture_overhead.py --model tiny --rounds 16
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from stages.models import resolve_model
from stages.paths import EVALUATION_PROMPTS
from stages.prompts import load_prompts

ENGINES = ("plain", "plain-again", "eldr", "eldr-eager")


def engine_kwargs(name: str, source: str, max_num_seqs: int) -> dict[str, Any]:
    from vllm.config import KVTransferConfig

    from stages.engine import kv_transfer_config, on_cpu

    kwargs: dict[str, Any] = dict(
        model=source, max_model_len=1024, max_num_seqs=max_num_seqs, seed=0,
        gpu_memory_utilization=0.2,
    )
    if on_cpu():
        kwargs |= {"dtype": "bfloat16", "distributed_executor_backend": "uni"}
    if name.startswith("eldr"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config("plain"))
    if name == "eldr-eager":
        kwargs["enforce_eager"] = True
    return kwargs


def serve_engine(name: str, source: str, args: argparse.Namespace, conn: Connection) -> None:
    """Child process: build one engine, then time each batch the parent sends."""
    from stages.engine import on_cpu

    if on_cpu():
        # Engine core and worker in this process and thread (see the module docstring). The
        # uniprocess executor does not apply vLLM's OpenMP binding, so set one thread here.
        import torch

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {int(args.cores)})
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(name, source, args.batch))
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    conn.send("ready")
    while (texts := conn.recv()) is not None:
        inputs = [{"prompt_token_ids": tokenizer.encode(t)[-512:]} for t in texts]
        cpu_start, start = time.process_time(), time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        conn.send((elapsed, cpu, sum(len(o.outputs[0].token_ids) for o in outputs)))


def median_ci(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Median and bootstrap 95% interval of the median."""
    data = np.asarray(values)
    rng = np.random.default_rng(seed)
    boots = np.median(rng.choice(data, size=(5000, len(data))), axis=1)
    low, high = np.percentile(boots, [2.5, 97.5])
    return float(np.median(data)), float(low), float(high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--settle", type=float, default=0.5,
                        help="seconds of quiet before each timed batch")
    parser.add_argument("--cores", default=str(max(os.sched_getaffinity(0))),
                        help="CPU build: the core every engine computes on (one thread).")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    source = resolve_model(args.model).source
    started = time.perf_counter()
    context = mp.get_context("spawn")
    links: dict[str, Connection] = {}
    children = []
    for name in ENGINES:  # one at a time: concurrent start-ups would share the cores
        parent, child = context.Pipe()
        proc = context.Process(target=serve_engine, args=(name, source, args, child))
        proc.start()
        if parent.recv() != "ready":
            raise RuntimeError(f"engine {name} did not start")
        links[name] = parent
        children.append(proc)
    print(f"{len(ENGINES)} engines ready in {time.perf_counter() - started:.0f} s")
    prompts = [p.prompt for p in load_prompts(EVALUATION_PROMPTS)]
    rates: dict[str, list[float]] = {name: [] for name in ENGINES}
    cpu_ms: dict[str, list[float]] = {name: [] for name in ENGINES}
    try:
        for r in range(args.rounds + 1):
            texts = [prompts[(r * args.batch + i) % len(prompts)] for i in range(args.batch)]
            # Rotate the order so no engine always runs first (or right after another).
            order = ENGINES[r % len(ENGINES):] + ENGINES[: r % len(ENGINES)]
            for name in order:
                time.sleep(args.settle)
                links[name].send(texts)
                elapsed, cpu, tokens = links[name].recv()
                if r > 0:  # round 0 warms every engine up
                    rates[name].append(tokens / elapsed)
                    cpu_ms[name].append(1000 * cpu / tokens)
            if r > 0:
                print(f"round {r:2d}: " + "   ".join(
                    f"{n} {rates[n][-1]:5.0f} tok/s {cpu_ms[n][-1]:5.3f} ms" for n in ENGINES
                ), flush=True)
    finally:
        for link in links.values():
            link.send(None)
        for proc in children:
            proc.join(timeout=60)
    print(f"\n{args.rounds} rounds x {args.batch} requests x {args.max_tokens} output tokens,"
          f" model {args.model}; ratio to plain: median of per-round ratios [95% interval]")
    print(f"{'engine':>11}  {'tok/s':>6}  {'wall-clock ratio':>22}  {'CPU ms/tok':>10}"
          f"  {'throughput from CPU work':>24}")
    for name in ENGINES:
        wall = median_ci([a / b for a, b in zip(rates[name], rates["plain"], strict=True)])
        work = median_ci([b / a for a, b in zip(cpu_ms[name], cpu_ms["plain"], strict=True)])
        print(f"{name:>11}  {statistics.median(rates[name]):6.0f}"
              f"  {wall[0]:6.3f} [{wall[1]:.3f}, {wall[2]:.3f}]"
              f"  {statistics.median(cpu_ms[name]):10.3f}"
              f"  {work[0]:6.3f} [{work[1]:.3f}, {work[2]:.3f}]")


if __name__ == "__main__":
    main()
