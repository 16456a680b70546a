"""What following one worker's KV events costs a proxy process, a batch: the floor under eldr-kv's
capacity where workers publish a batch per prompt.

A publisher process (the bench fakes' ``FakeKVPublisher``, as ``examples.bench_proxy`` runs
it: a new prompt of ``--prompt-tokens`` stores its blocks of 128 in one ``BlockStored`` with
its first block's ids, and evictions past 4,096 blocks ride in the same batch) sends
``--rate`` batches a second. This process measures its own CPU, every thread (ZeroMQ's I/O
thread too), a batch received, three ways:
  receive   a plain SUB socket, a blocking recv a message: what any Python subscriber pays
  drain     the same socket read every 5 ms, whatever queued (no wake-up a message)
  follow    eldr's follower into a KV view, as ``eldr serve`` runs it: received, decoded,
            applied, a new first block's text read

    python -m examples.bench_kv_follow                      # about 1 min
    python -m examples.bench_kv_follow --rate 1500 --batches 15000
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from collections.abc import Callable

import zmq

from stages.paths import BUNDLED_MODELS_DIR

MODES = ("receive", "drain", "follow")
WARMUP = 200  # batches before the measured ones: connections, replay, first allocations
DRAIN_EVERY_S = 0.005


def publish(endpoint: str, rate: float, count: int, prompt_tokens: int) -> None:
    """``count`` batches at ``rate`` a second, a second after binding (for the subscriber)."""
    from examples.bench_proxy import long_prompts
    from tests.fakes.kv_publisher import FakeKVPublisher

    texts, chars_per_token = long_prompts(prompt_tokens)
    assert texts is not None
    publisher = FakeKVPublisher(endpoint, None, chars_per_token=chars_per_token,
                                head_model=str(BUNDLED_MODELS_DIR / "tiny"))
    time.sleep(1.0)
    start = time.perf_counter()
    for i in range(count):
        # A number first, as bench_proxy's single-turn prompts: every prompt new.
        publisher.ran({"prompt": f"{i}: {texts[i % len(texts)]}"}, chat=False)
        delay = start + (i + 1) / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    time.sleep(1.0)  # the last batches on their way
    publisher.close()


def measured(count: int, run: Callable[[int], None]) -> float:
    """CPU seconds of this process while ``run`` takes ``count`` batches."""
    start = time.process_time()
    run(count)
    return time.process_time() - start


def bare(endpoint: str, batches: int, take: Callable[[zmq.Socket, int], None]) -> float:
    """CPU while ``take`` reads ``batches`` from a plain SUB socket, after a warm-up."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    try:
        take(sub, WARMUP)
        return measured(batches, lambda n: take(sub, n))
    finally:
        sub.close(linger=0)


def blocking(sub: zmq.Socket, n: int) -> None:
    for _ in range(n):
        sub.recv_multipart()


def periodic(sub: zmq.Socket, n: int) -> None:
    while n > 0:
        time.sleep(DRAIN_EVERY_S)
        while n > 0 and sub.poll(0):
            sub.recv_multipart()
            n -= 1


def follow(endpoint: str, batches: int) -> float:
    from stages.routing.kv.first_block_texts import FirstBlockTexts
    from stages.routing.kv.prompt_tokens import PromptTokenizer
    from stages.serve.proxy.view.kv_events import KVEventSource, KVView, follow_kv_events

    tokenizer = PromptTokenizer(str(BUNDLED_MODELS_DIR / "tiny"))
    texts = FirstBlockTexts(tokenizer.backend, tokenizer.head_specials)

    async def main() -> float:
        view = KVView(1, first_blocks=texts.stored_event)
        task = asyncio.create_task(follow_kv_events([KVEventSource.parse(endpoint)], view))

        async def applied(n: int) -> None:
            # Polled 20 times a second: a few microseconds a poll against the batches' cost.
            while int(view.events[0]) < n:
                await asyncio.sleep(0.05)

        await applied(WARMUP)
        start = time.process_time()
        await applied(WARMUP + batches)
        cpu = time.process_time() - start
        if int(view.lost[0]) or int(view.undecodable[0]):
            raise SystemExit(f"follow: {view.state()[0]}: batches lost on the way")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return cpu

    return asyncio.run(main())


RUNS: dict[str, Callable[[str, int], float]] = {
    "receive": lambda e, n: bare(e, n, blocking),
    "drain": lambda e, n: bare(e, n, periodic),
    "follow": follow,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--rate", type=float, default=700.0,
                        help="batches a second (bench_proxy's eldr-kv at concurrency 64 gets"
                        " about 700 prompts a second, each a batch from two workers)")
    parser.add_argument("--batches", type=int, default=7000, help="measured, per mode")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    args = parser.parse_args()
    from examples.bench_proxy import kv_event_ports

    print(f"{'mode':>8} {'batches':>8} {'us CPU a batch':>15}")
    for mode in args.modes:
        endpoint = f"tcp://127.0.0.1:{kv_event_ports(1, [])[0]}"
        sender = mp.get_context("spawn").Process(
            target=publish, args=(endpoint, args.rate, WARMUP + args.batches + 100,
                                  args.prompt_tokens), daemon=True)
        sender.start()
        try:
            cpu = RUNS[mode](endpoint, args.batches)
        finally:
            sender.kill()
            sender.join()
        print(f"{mode:>8} {args.batches:>8} {1e6 * cpu / args.batches:>15.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
