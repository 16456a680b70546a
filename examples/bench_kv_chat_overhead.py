"""Where a KV-aware proxy's latency goes on chat traffic with growing histories: each stage of
eldr-kv's request path timed in the proxy process, against eldr-union's, on fake vLLM workers
that publish real KV events.

Fakes: 2 prefill and 2 decode workers (``tests.fakes.lean_worker``), each publishing vLLM's KV
events with the real block hashes of the bundled ``tiny``'s tokenizer (``FakeKVPublisher``,
block size 128 as on CPU), answering at once: what is left of a request's time is the proxy's
and the sockets'. The proxy is ``eldr serve --attach-*``'s own config (``deploy.plan``) run
by ``run_proxy`` in a process of this script's, which first wraps the request path's stages
with ``perf_counter_ns`` timers (the stages' code is unchanged; the timers cost about a
microsecond each). Routers take turns, ``--rounds`` times, a fresh proxy each time; a round's
clients each run conversations of ``--turns`` turns (a shared system prompt, then each turn's
user message and the answer appended: the history grows to about ``--history-tokens``),
streaming, and time the first byte.

Per router: the client's time to first byte, the proxy's CPU per request, and the mean time of
each stage per request (us): the prompt's tokens and hashes (``KVRouting.prompt``), the rest of
the request's set-up, the local-prefill and arrival choices, the prefill choice, the prefill
worker's answer (headers, then body), what lies between the prefill's answer and the decode
request (signature, decision), the decode worker's first byte, and the KV event batches the
proxy applied (count, time, and how much of it fell inside a request's own window).

    python -m examples.bench_kv_chat_overhead [--rounds 3] [--concurrency 1] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from functools import partialmethod
from pathlib import Path
from typing import Any

import numpy as np

from stages.paths import BUNDLED_MODELS_DIR
from stages.serve.cluster.ports import free_ports

try:
    from examples.bench_proxy import cpu_seconds, kv_event_ports, serve_fakes
except ModuleNotFoundError as exc:
    if exc.name not in ("tests", "examples"):
        raise
    raise SystemExit(
        f"{exc}: run from the repo root as `python -m examples.bench_kv_chat_overhead`"
    ) from exc

ROUTERS = ("eldr-union", "eldr-kv")
TINY = str(BUNDLED_MODELS_DIR / "tiny")
WORDS = ("the router reads each worker's cache of blocks and sends the request where its prompt"
         " is already held or where the queue is short experts decide the decode worker while"
         " the prefix decides the prefill worker for every turn of a long conversation").split()


# -- the proxy, timed ---------------------------------------------------------------------

class Timeline:
    """Per request (by eldr's request id): each stage's start and end, ns. Written to a JSON
    file when the proxy stops."""

    def __init__(self) -> None:
        self.marks: dict[str, dict[str, list[int]]] = defaultdict(dict)
        self.applies: list[tuple[int, int]] = []  # (start, end) of each KV batch applied
        self.current: str | None = None  # the request whose context is being made

    def mark(self, request_id: str, stage: str, t0: int, t1: int) -> None:
        self.marks[request_id].setdefault(stage, []).extend((t0, t1))

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps({"requests": self.marks, "applies": self.applies}))


def _timed_sync(timeline: Timeline, stage: str, fn: Any) -> Any:
    clock = time.perf_counter_ns

    def wrapper(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(ctx, *args, **kwargs)
        finally:
            timeline.mark(ctx.request_id, stage, t0, clock())

    return wrapper


def _timed_async(timeline: Timeline, stage: str, fn: Any) -> Any:
    clock = time.perf_counter_ns

    async def wrapper(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return await fn(ctx, *args, **kwargs)
        finally:
            timeline.mark(ctx.request_id, stage, t0, clock())

    return wrapper


def _timed_part(timeline: Timeline, stage: str, fn: Any) -> Any:
    """A part of the request whose context is being made (else not timed)."""
    clock = time.perf_counter_ns

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            if timeline.current is not None:
                timeline.mark(timeline.current, stage, t0, clock())

    return wrapper


def install_timers(timeline: Timeline, prefill_urls: tuple[str, ...]) -> None:
    """Wraps the request path's stages where the front and the legs look them up; before the
    app is built, so every name bound at import is a wrapped one."""
    from stages.serve.proxy.client import http1
    from stages.serve.proxy.front import completions, request
    from stages.serve.proxy.legs import prefill
    from stages.serve.proxy.router.decode_router import DecodeRouter
    from stages.serve.proxy.view.kv_events import KVView
    from stages.serve.proxy.view.kv_routing import KVRouting

    clock = time.perf_counter_ns
    make_context = request.request_context

    def request_context(req: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        timeline.current = request_id
        try:
            return make_context(req, request_id, *args, **kwargs)
        finally:
            timeline.current = None
            timeline.mark(request_id, "context", t0, clock())

    completions.request_context = request_context
    prompt = KVRouting.prompt

    def kv_prompt(self: KVRouting, *args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return prompt(self, *args, **kwargs)
        finally:
            if timeline.current is not None:
                timeline.mark(timeline.current, "prompt", t0, clock())

    KVRouting.prompt = kv_prompt  # type: ignore[method-assign]
    from stages.routing.kv.block_hashes import BlockHasher
    from stages.routing.kv.prompt_tokens import PromptTokenizer

    # The prompt's parts: rendering (the chat template), its ids, its blocks' hashes.
    for owner, name in ((PromptTokenizer, "render"), (PromptTokenizer, "ids"),
                        (BlockHasher, "hashes")):
        setattr(owner, name, _timed_part(timeline, f"prompt.{name}", getattr(owner, name)))
    for name in ("run_local", "run_prefill", "run_decode"):
        setattr(completions, name, _timed_async(timeline, name, getattr(completions, name)))
    for name in ("choose_at_arrival", "hand_off"):
        setattr(completions, name, _timed_sync(timeline, name, getattr(completions, name)))
    prefill.choose_prefill = _timed_sync(timeline, "choose_prefill", prefill.choose_prefill)
    choose = DecodeRouter.choose

    def decode_choose(self: DecodeRouter, *args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return choose(self, *args, **kwargs)
        finally:
            timeline.mark("-", "decode_choose", t0, clock())

    DecodeRouter.choose = decode_choose  # type: ignore[method-assign]
    send = http1.Http1Client.request

    async def upstream(self: Any, method: str, url: str, path: str, body: bytes,
                       headers: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return await send(self, method, url, path, body, headers, *args, **kwargs)
        finally:
            rid = headers.get("X-Request-Id") if headers is not None else None
            if rid is not None:
                leg = "up_prefill" if url in prefill_urls else "up_decode"
                timeline.mark(rid, leg, t0, clock())

    # ``post`` is a partialmethod of the original ``request``: it is the one the legs call.
    http1.Http1Client.post = partialmethod(upstream, "POST")  # type: ignore[assignment]
    apply = KVView.apply

    def kv_apply(self: KVView, *args: Any, **kwargs: Any) -> None:
        t0 = clock()
        try:
            apply(self, *args, **kwargs)
        finally:
            timeline.applies.append((t0, clock()))

    KVView.apply = kv_apply  # type: ignore[method-assign]


def serve_timed(config: Any, port: int, out: Path) -> None:
    """The proxy, its stages timed; the timeline written to ``out`` when it stops."""
    timeline = Timeline()
    install_timers(timeline, config.prefill_urls)
    from stages.serve.proxy.app import run_proxy

    # Written when it is told to stop (the clients are done by then): it then drains and
    # re-raises the signal, so nothing after ``run_proxy`` runs.
    run_proxy(config, port=port, log_level="warning", drain_timeout_s=1.0,
              on_signal=lambda: timeline.dump(out))


def proxy_config(policy: str, prefill: list[str], decode: list[str], kv_events: list[str],
                 port: int) -> Any:
    from stages.serve.deploy import ServeOptions, plan

    options = ServeOptions(
        policy=policy, port=port, attach_prefill=tuple(prefill), attach_decode=tuple(decode),
        attach_kv_events=tuple(kv_events) if policy == "eldr-kv" else (),
        max_queued=None, served_model_name="fake-model")
    return replace(plan(options).proxy, model="fake-model")


# -- the clients --------------------------------------------------------------------------

def words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


async def converse(url: str, concurrency: int, seconds: float, turns: int, seed: int,
                   history_tokens: int, single: bool = False,
                   think_s: float = 0.0) -> list[tuple[int, float, float]]:
    """Closed-loop conversations; per turn (turn number, ms to first byte, ms in all).
    ``single``: single-turn completions instead, each a new prompt of about
    ``history_tokens`` tokens (a request number first: no block of it is held anywhere)."""
    import orjson

    from stages.serve.proxy.client.http1 import Http1Client, Timeouts

    rng = np.random.default_rng(seed)
    # Words of WORDS are about 1.3 tokens each: the system prompt takes a fifth of the
    # history, each turn's question and answer share the rest.
    system = words(rng, history_tokens // 7)
    per_turn = max(8, history_tokens * 4 // 5 // max(1, turns) // 2 * 10 // 13)
    stop_at = time.monotonic() + seconds
    out: list[tuple[int, float, float]] = []
    timeouts = Timeouts(read_s=60.0, connect_s=60.0, acquire_s=60.0)
    headers = {"content-type": "application/json"}

    texts = [words(rng, history_tokens * 10 // 13) for _ in range(16)]

    async def one(http: Http1Client, path: str, body: bytes) -> tuple[float, float] | None:
        t0 = time.perf_counter()
        r = await http.post(url, path, body, headers, timeouts)
        first = None
        try:
            async for _ in r.iter_chunks():
                if first is None:
                    first = time.perf_counter()
            ok = r.status == 200
        finally:
            r.release()
        end = time.perf_counter()
        return (1e3 * (first - t0), 1e3 * (end - t0)) if ok and first is not None else None

    async def single_turns(c: int, http: Http1Client) -> None:
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            body = orjson.dumps({"model": "fake-model", "max_tokens": 8, "stream": True,
                                 "prompt": f"{seed} {c} {n}: {texts[n % len(texts)]}"})
            timed = await one(http, "/v1/completions", body)
            if timed is not None:
                out.append((1, *timed))
            await asyncio.sleep(think_s)

    async def client(c: int, http: Http1Client) -> None:
        if single:
            return await single_turns(c, http)
        conversation = 0
        while time.monotonic() < stop_at:
            conversation += 1
            messages = [{"role": "system", "content": system}]
            for turn in range(turns):
                if time.monotonic() >= stop_at:
                    return
                messages.append({"role": "user", "content": f"client {c} conversation"
                                 f" {conversation} seed {seed}: {words(rng, per_turn // 3)}"})
                body = orjson.dumps({"model": "fake-model", "messages": messages,
                                     "max_tokens": 8, "stream": True})
                timed = await one(http, "/v1/chat/completions", body)
                if timed is not None:
                    out.append((turn, *timed))
                await asyncio.sleep(think_s)  # the user reads the answer
                messages.append({"role": "assistant", "content": words(rng, per_turn)})

    async with Http1Client(max_connections=concurrency, keepalive_s=4.0) as http:
        await asyncio.gather(*(client(c, http) for c in range(concurrency)))
    return out


# -- one run ------------------------------------------------------------------------------

STAGES = ("prompt", "prompt.render", "prompt.ids", "prompt.hashes", "context_rest", "run_local",
          "choose_at_arrival", "choose_prefill",
          "to_prefill_send", "up_prefill", "prefill_after", "between_legs", "hand_off",
          "decode_choose", "up_decode", "proxy_own")


def stage_breakdown(timeline: dict[str, Any]) -> dict[str, Any]:
    """Mean us per request of each stage, from a proxy's timeline (requests with both legs)."""
    rows: dict[str, list[float]] = defaultdict(list)
    applies = np.array(timeline["applies"], dtype=np.int64).reshape(-1, 2)
    inside = inside_count = 0.0
    decode_choose = timeline["requests"].get("-", {}).get("decode_choose", [])
    n = 0
    first = last = None
    for rid, marks in timeline["requests"].items():
        if rid == "-" or "up_decode" not in marks or "up_prefill" not in marks:
            continue
        n += 1

        def dur(stage: str, m: dict[str, list[int]] = marks) -> float:
            t = m.get(stage, [])
            return sum(t[i + 1] - t[i] for i in range(0, len(t), 2)) / 1e3

        c0, c1 = marks["context"][:2]
        p0, p1 = marks["up_prefill"][:2]
        r1 = marks["run_prefill"][1]
        d0 = marks["up_decode"][0]
        d1 = marks["up_decode"][1]
        for part in ("prompt", "prompt.render", "prompt.ids", "prompt.hashes"):
            rows[part].append(dur(part))
        rows["context_rest"].append((c1 - c0) / 1e3 - dur("prompt"))
        rows["run_local"].append(dur("run_local"))
        rows["choose_at_arrival"].append(dur("choose_at_arrival"))
        rows["choose_prefill"].append(dur("choose_prefill"))
        rows["to_prefill_send"].append((p0 - c0) / 1e3)
        rows["up_prefill"].append((p1 - p0) / 1e3)
        rows["prefill_after"].append((r1 - p1) / 1e3)
        rows["between_legs"].append((d0 - r1) / 1e3)
        rows["hand_off"].append(dur("hand_off"))
        rows["up_decode"].append((d1 - d0) / 1e3)
        first = c0 if first is None else min(first, c0)
        last = d1 if last is None else max(last, d1)
        rows["proxy_own"].append(((p0 - c0) + (r1 - p1) + (d0 - r1)) / 1e3)
        if len(applies):
            within = (applies[:, 0] >= c0) & (applies[:, 1] <= d1)
            inside += float((applies[within, 1] - applies[within, 0]).sum()) / 1e3
            inside_count += float(within.sum())
    means = {k: float(np.mean(v)) for k, v in rows.items()}
    if decode_choose and n:
        t = decode_choose
        means["decode_choose"] = sum(t[i + 1] - t[i] for i in range(0, len(t), 2)) / 1e3 / n
    if len(applies) and first is not None:
        applies = applies[(applies[:, 0] >= first) & (applies[:, 1] <= last)]
    applied = (applies[:, 1] - applies[:, 0]) / 1e3 if len(applies) else np.zeros(0)
    means["kv_batches"] = len(applied) / max(1, n)
    means["kv_apply"] = float(applied.sum()) / max(1, n)
    means["kv_apply_inside"] = inside / max(1, n)
    means["kv_batches_inside"] = inside_count / max(1, n)
    means["requests"] = n
    return means


def run_one(router: str, round_: int, args: argparse.Namespace, prefill: list[str],
            decode: list[str], kv_events: list[str], home: Path) -> dict[str, Any]:
    import uvloop

    from stages.procs.health import wait_healthy

    ctx = mp.get_context("spawn")
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    out = home / f"{router}-{round_}.json"
    config = proxy_config(router, prefill, decode, kv_events, port)
    proc = ctx.Process(target=serve_timed, args=(config, port, out),
                       daemon=True)
    proc.start()
    try:
        wait_healthy(url, 120, lambda: proc.exitcode, interval_s=0.2)
        # Warm: code paths, connections, and the KV view's replay of what the fakes hold.
        uvloop.run(converse(url, 1, 1.0, args.turns, 10_000 + round_, args.history_tokens,
                            args.single))
        time.sleep(1.0)
        cpu0 = cpu_seconds(proc.pid)
        turns = uvloop.run(converse(url, args.concurrency, args.seconds, args.turns,
                                    round_ * 1000 + ROUTERS.index(router) + 1,
                                    args.history_tokens, args.single, args.think_ms / 1000))
        cpu = cpu_seconds(proc.pid) - cpu0
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(30)
    timeline = json.loads(out.read_text())
    # Only the measured requests: the warm-up's were the first ones.
    rids = [r for r in timeline["requests"] if r != "-"]  # "-" holds the decisions
    kept = {r: timeline["requests"][r] for r in rids[max(0, len(rids) - len(turns)):]}
    timeline["requests"] = {**kept, "-": timeline["requests"].get("-", {})}
    later = [t for t in turns if t[0] >= 1]
    return {"router": router, "round": round_, "requests": len(turns),
            "ttft_ms": float(np.mean([t[1] for t in later])) if later else float("nan"),
            "ttft_p50_ms": float(np.median([t[1] for t in later])) if later else float("nan"),
            "cpu_ms_per_request": 1e3 * cpu / max(1, len(turns)),
            "stages_us": stage_breakdown(timeline)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="per router and round")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--history-tokens", type=int, default=2000,
                        help="about how long the last turn's prompt gets")
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="each client waits this long after an answer before its next"
                        " request")
    parser.add_argument("--single", action="store_true",
                        help="single-turn completions instead of conversations: each request a"
                        " new prompt of about --history-tokens tokens")
    parser.add_argument("--out", type=Path, default=Path("bench_kv_chat_overhead.json"))
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    ports = free_ports(4)
    prefill = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    decode = [f"http://127.0.0.1:{p}" for p in ports[2:]]
    kv_events = [f"tcp://127.0.0.1:{p}" for p in kv_event_ports(4, ports)]
    fakes = [ctx.Process(target=serve_fakes, daemon=True,
                         args=(ports[i:i + 2], 8, 0.0, None, kv_events[i:i + 2], 4.0, TINY))
             for i in (0, 2)]
    for f in fakes:
        f.start()
    home = Path(tempfile.mkdtemp(prefix="eldr-bench-kv-chat-"))
    results = []
    try:
        from stages.procs.health import wait_healthy

        for u in prefill + decode:
            wait_healthy(u, 60, lambda: None, interval_s=0.1)
        for round_ in range(args.rounds):
            order = args.routers if round_ % 2 == 0 else args.routers[::-1]
            for router in order:
                result = run_one(router, round_, args, prefill, decode, kv_events, home)
                results.append(result)
                s = result["stages_us"]
                print(f"round {round_} {router:>10}: {result['requests']:5d} requests,"
                      f" TTFT turns>=2 mean {result['ttft_ms']:6.2f} ms"
                      f" (p50 {result['ttft_p50_ms']:5.2f}),"
                      f" proxy CPU {result['cpu_ms_per_request']:5.2f} ms/req,"
                      f" proxy's own {s.get('proxy_own', float('nan')):7.1f} us", flush=True)
    finally:
        for f in fakes:
            f.kill()
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nmean us per request per stage (min-max over {args.rounds} rounds):")
    keys = [*STAGES, "kv_batches", "kv_apply", "kv_batches_inside", "kv_apply_inside"]
    print(f"{'stage':>18} " + " ".join(f"{r:>22}" for r in args.routers))
    for key in keys:
        cells = []
        for router in args.routers:
            v = [r["stages_us"].get(key, float("nan")) for r in results if r["router"] == router]
            cells.append(f"{np.mean(v):8.1f} ({min(v):6.1f}-{max(v):6.1f})")
        print(f"{key:>18} " + " ".join(f"{c:>22}" for c in cells))
    for key, unit in (("ttft_ms", "ms"), ("cpu_ms_per_request", "ms")):
        cells = []
        for router in args.routers:
            v = [r[key] for r in results if r["router"] == router]
            cells.append(f"{np.mean(v):8.2f} ({min(v):6.2f}-{max(v):6.2f})")
        print(f"{key + ' ' + unit:>18} " + " ".join(f"{c:>22}" for c in cells))
    print(f"written {args.out}; timelines in {home}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
