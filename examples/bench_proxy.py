"""Router capacity: eldr's proxy against vllm-router (the Rust router, PD mode) on the same fake
vLLM workers, in the same run.

Processes: fake prefill workers and fake decode workers (``tests.fakes.worker``'s answers on
a bare server, ``tests.fakes.lean_worker``, that leaves the routers the CPU: a prefill
answers with ``kv_transfer_params`` carrying a signature, a decode answers JSON or streams SSE
as vLLM does), each router under test started as users start it (``eldr serve --attach-*``,
``vllm-router --vllm-pd-disaggregation``), and a load generator in its own process. "direct"
sends the same requests to a decode worker itself: what no router at all costs.

Workloads, each at every ``--concurrency`` (closed loop: each client sends its next request
when the last one ended):
  plain   not streaming, ``--tokens`` tokens in one JSON answer
  burst   streaming ``--tokens`` tokens with no delay (chunks coalesce into large reads)
  paced   streaming one token every ``--pace-ms`` (25 ms: a decode step): nothing coalesces
and ``plain`` at concurrency 1 for the latency a router adds.

Per point: requests/s, relayed SSE chunks/s, latency p50/p99 (whole response; for streams, the
whole stream), the router's CPU (cores, ms per request, us per chunk, and the kernel's share:
socket reads and writes cost any router about the same, so the rest is its own code), and the
fake workers' CPU per request (what a router makes them do). The fakes, the routers and the
load generator share this machine's cores, so a router's figures are also bounded by what the
others leave it: compare routers within one run, and read the CPU columns.

    python -m examples.bench_proxy                       # from the repo root; about 15 min
    python -m examples.bench_proxy --seconds 10 --concurrency 64 --workloads plain paced
    python -m examples.bench_proxy --routers eldr-union --profile prof/   # where its CPU goes
    python -m examples.bench_proxy --routers eldr-union-pub eldr-union-rec --workloads plain \
        --concurrency 64                                  # what `eldr serve --record` costs
    python -m examples.bench_proxy --routers eldr-union eldr-kv --workloads plain \
        --prompt-tokens 2000                              # what KV-aware routing costs
    git worktree add /tmp/base COMMIT && python -m examples.bench_proxy --baseline /tmp/base \
        --routers eldr-union@base eldr-kv --workloads plain --concurrency 64 \
        --prompt-tokens 2000 --rounds 4                   # against an earlier eldr, in turns

Prompts: by default 16 short ones (about 8 tokens), repeated. ``--prompt-tokens N``: every
request's prompt is its own (a request number, then one of 16 texts of about N tokens of the
bundled ``tiny``'s tokenizer): single-turn traffic, nothing cached anywhere, so eldr-kv
tokenizes and hashes every prompt cold; with ``--repeat-prompts`` the 16 texts repeat (what the
workers hold hits). For eldr-kv the fake workers publish vLLM's KV events
(tests.fakes.kv_publisher: block size 128 as on CPU; stand-in block hashes for new prompts, so
the fakes tokenize only a new prompt's head, for its first block's ids, and real hashes for
repeated prompts) and the proxy subscribes to them
(``--attach-kv-events``); every router measured with it runs on the same publishing fakes.
The publishers run in the fakes' processes, never the router's, and a KV-aware router's points
start once its view has replayed what they buffered before it (start-up, not per request).
They send one batch per prompt (as a vLLM engine whose every step ran one prompt); vLLM sends
one per engine step, with the events of every prompt the step ran: ``--kv-step-ms`` publishes
so, a batch per step of that many ms.

``--baseline DIR`` measures eldr's routers from another checkout too (``git worktree add DIR
COMMIT``), in the same run on the same fakes: ``NAME@base`` is router NAME started from DIR, so
a change is judged against what users ran before it, on this minute's machine.

``--profile DIR`` samples each eldr router with py-spy (``pip install py-spy``) during every
point: a flame graph per point in DIR, and the functions with the most CPU printed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from stages.paths import BUNDLED_MODELS_DIR
from stages.procs import linux
from stages.procs.health import wait_healthy
from stages.serve.cluster.ports import free_ports

try:
    from tests.fakes import lean_worker
    from tests.fakes.kv_publisher import FakeKVPublisher
    from tests.fakes.worker import FakeBehavior
except ModuleNotFoundError as exc:
    if exc.name != "tests":
        raise
    raise SystemExit(f"{exc}: run from the repo root as `python -m examples.bench_proxy`") from exc

# "-2p": the same policy with two proxy processes on the port (eldr serve --proxy-workers 2).
# "-pub": subscribed to each decode worker's published batch (--attach-batch); "-rec": the same,
# recording every request (--record), so the pair shows what recording adds.
ROUTERS = ("direct", "eldr-union", "eldr-union-2p", "eldr-union-pub", "eldr-union-rec", "eldr-kv",
           "rr", "vllm-router")
KV_AWARE = ("eldr-kv",)  # routers that subscribe to the workers' KV events
WORKLOADS = ("plain", "burst", "paced")
PROMPT_NUMBERS = 10**8  # new prompts one point may send, at most


@dataclass(frozen=True)
class Point:
    router: str
    workload: str
    concurrency: int
    seconds: float
    requests: int
    failed: int
    chunks: int
    latency_p50_ms: float
    latency_p99_ms: float
    router_cpu_s: float
    workers_cpu_s: float  # the fake workers' (prefill and decode): what a router makes them do
    # The router's CPU spent in the kernel (sockets): the same for any router that sends the
    # same bytes in as many writes, so what is left is what its own code costs.
    router_sys_s: float = 0.0
    round: int = 0  # of --rounds: the routers take turns, each started again every round

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.seconds

    @property
    def cores(self) -> float:
        return self.router_cpu_s / self.seconds

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.router_cpu_s / max(1, self.requests)

    @property
    def cpu_us_per_chunk(self) -> float:
        return 1e6 * self.router_cpu_s / max(1, self.chunks)

    @property
    def sys_share(self) -> float:
        return self.router_sys_s / self.router_cpu_s if self.router_cpu_s else 0.0

    @property
    def workers_cpu_ms_per_request(self) -> float:
        return 1000 * self.workers_cpu_s / max(1, self.requests)


# -- fake workers -------------------------------------------------------------------------

def serve_fakes(ports: list[int], tokens: int, pace_s: float,
                batch_ports: list[int] | None = None, kv_events: list[str] | None = None,
                chars_per_token: float = 4.0, kv_model: str | None = None,
                kv_step_s: float = 0.0) -> None:
    """One process, one fake vLLM server on every port (prefill or decode by the request).
    With ``batch_ports`` each is a decode worker publishing its batch there, as eldr's
    connector does (and the decode counts of requests a proxy records). The fakes answer as
    tests.fakes.worker's do, on a bare server (tests.fakes.lean_worker) that leaves the
    router under test the CPU that Starlette and uvicorn would take."""
    from stages.capture.batch_publisher import BatchPublisher

    def fake(publish: int | None) -> FakeBehavior:
        publisher = None if publish is None else BatchPublisher(f"tcp://127.0.0.1:{publish}")
        return FakeBehavior("bench", tokens=tokens, token_delay_s=pace_s, record=False,
                            publisher=publisher)

    behaviors = [fake(batch_ports[i] if batch_ports else None) for i in range(len(ports))]
    # Stand-in block hashes (kv_model None) where every prompt is new: tokenizing each would
    # cost the fakes the router's cores. Repeated prompts get real ones, hashed once each.
    # Their first blocks' ids, as vLLM's events carry them, from each prompt's head alone.
    heads = str(BUNDLED_MODELS_DIR / "tiny")
    kv = [FakeKVPublisher(e, kv_model, chars_per_token=chars_per_token, head_model=heads,
                          step_s=kv_step_s) for e in kv_events or []]
    lean_worker.serve([lean_worker.listening_socket(port) for port in ports], behaviors, kv)


# -- routers ------------------------------------------------------------------------------

BASE = "@base"  # a router's name suffix: started from the --baseline checkout


def start_router(name: str, port: int, prefill: list[str], decode: list[str],
                 batches: list[str], kv_events: list[str], home: Path,
                 baseline: Path | None = None) -> subprocess.Popen[bytes] | None:
    """``name`` as --routers gives it; its log and recording are its own, a base router's
    apart from the same router's of this checkout."""
    env = {**os.environ, "ELDR_HOME": str(home)}
    cwd = None
    if name.endswith(BASE):
        if baseline is None:
            raise SystemExit(f"{name}: no --baseline checkout given")
        cwd = baseline
        # `python -m` imports from the working directory first; PYTHONPATH covers the
        # subprocesses it spawns (--proxy-workers).
        env["PYTHONPATH"] = str(baseline)
    router = kind(name)
    if router == "direct":
        return None
    if router == "vllm-router":
        argv = [_tool("vllm-router"), "--vllm-pd-disaggregation", "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning", "--prefill-policy", "round_robin",
                # Its metrics port defaults to 29000, which another router on the host may hold.
                "--prometheus-port", str(free_ports(1, [port])[0]),
                "--decode-policy", "round_robin"]
        for url in prefill:
            argv += ["--prefill", url]
        for url in decode:
            argv += ["--decode", url]
    else:
        policy = router.removesuffix("-2p").removesuffix("-pub").removesuffix("-rec")
        processes = "2" if router.endswith("-2p") else "1"
        # Capacity, not load shedding, is measured: no bound on the requests in flight (the
        # default sheds past 256 when the workers' slots are unknown, as with --attach-*).
        argv = [sys.executable, "-m", "eldr_cli", "serve", "--policy", policy, "--port",
                str(port), "--log-level", "warning", "--proxy-workers", processes,
                "--max-queued", str(10**9)]
        for url in prefill:
            argv += ["--attach-prefill", url]
        for i, url in enumerate(decode):
            argv += ["--attach-decode", url]
            if subscribes(name):
                argv += ["--attach-batch", batches[i]]
        if router.endswith("-rec"):
            argv += ["--record", "--record-to", str(recorded(home, name))]
        if router in KV_AWARE:
            for endpoint in kv_events:  # prefill workers first, as --attach-* lists them
                argv += ["--attach-kv-events", endpoint]
    log = (home / f"{name}.log").open("wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True)


def recorded(home: Path, router: str) -> Path:
    return home / f"{router}-traffic.zarr"


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def cpu_times(root: int) -> tuple[float, float]:
    """CPU of ``root`` and every process below it: user + system, and system alone."""
    tick = os.sysconf("SC_CLK_TCK")
    total = system = 0.0
    for pid in [root, *(i.pid for i in linux.descendants(root))]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
        system += int(fields[12]) / tick
    return total, system


def cpu_seconds(root: int) -> float:
    """User + system CPU of ``root`` and every process below it."""
    return cpu_times(root)[0]


# -- load generator -----------------------------------------------------------------------

def generate(url: str, workload: str, concurrency: int, seconds: float, tokens: int,
             prompts: list[str] | None, unique: bool, first: int, out: mp.Queue) -> None:
    """Closed-loop clients for ``seconds``; puts (requests, failed, chunks, latencies)."""
    import uvloop

    out.put(uvloop.run(_generate(url, workload, concurrency, seconds, tokens, prompts,
                                 unique, first)))


async def _generate(url: str, workload: str, concurrency: int, seconds: float,
                    tokens: int, prompts: list[str] | None = None,
                    unique: bool = True, first: int = 0) -> tuple[int, int, int, list[float]]:
    """``first``: the number the first new prompt starts with (``unique``); each point of a
    run starts past the last one's, so no point repeats a prompt an earlier one sent."""
    # eldr's own upstream client: a fraction of aiohttp's CPU per request, which the router
    # under test would otherwise lose to the load generator.
    from stages.serve.proxy.client.http1 import Http1Client, Timeouts, UpstreamError

    stream = workload != "plain"
    if prompts is None or not unique:
        texts = prompts or [f"domain={d} benchmark prompt" for d in range(16)]
        bodies = [json.dumps({"model": "fake-model", "prompt": text, "max_tokens": tokens,
                              "stream": stream}).encode() for text in texts]
    else:
        # A request number in front makes every prompt new (no block of it cached anywhere);
        # the body is spliced around it, not encoded again per request.
        mark = "\x00"
        halves = [json.dumps({"model": "fake-model", "prompt": f"{mark} {p}",
                              "max_tokens": tokens, "stream": stream}).encode().split(
                                  json.dumps(mark)[1:-1].encode())
                  for p in prompts]
    sent = [first]

    def body(i: int) -> bytes:
        if prompts is None or not unique:
            return bodies[i % len(bodies)]
        sent[0] += 1
        head, tail = halves[i % len(halves)]
        return b"%s%d%s" % (head, sent[0], tail)
    latencies: list[float] = []
    counts = [0, 0]  # failed, chunks
    stop_at = time.monotonic() + seconds
    parts = urlsplit(url)
    origin, path = f"{parts.scheme}://{parts.netloc}", parts.path
    headers = {"content-type": "application/json"}
    timeouts = Timeouts(read_s=600.0, connect_s=600.0, acquire_s=600.0)

    async def client(i: int) -> None:
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            r = None
            try:
                r = await http.post(origin, path, body(i), headers, timeouts)
                if stream:
                    tail = b""
                    async for piece in r.iter_chunks():
                        seen = tail + piece
                        counts[1] += seen.count(b"data: ") - tail.count(b"data: ")
                        tail = seen[-5:]
                else:
                    await r.read()
                    counts[1] += 1
                ok = r.status == 200
            except UpstreamError:
                ok = False
            finally:
                if r is not None:
                    r.release()
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                counts[0] += 1
            i += 1

    # Keep-alive below the routers' own (uvicorn's 5 s default at the least).
    async with Http1Client(max_connections=concurrency, keepalive_s=4.0) as http:
        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return len(latencies), counts[0], counts[1], latencies


def start_profile(proc: subprocess.Popen[bytes] | None, router: str, out: Path | None,
                  name: str, seconds: float) -> subprocess.Popen[bytes] | None:
    """py-spy sampling an eldr router (and its children) for one point; None when not asked."""
    if out is None or proc is None or router in ("direct", "vllm-router"):
        return None
    out.mkdir(parents=True, exist_ok=True)
    argv = [_tool("py-spy"), "record", "--pid", str(proc.pid), "--subprocesses", "--nonblocking",
            "--rate", "200", "--duration", str(max(1, int(seconds))), "--format", "raw",
            "-o", str(out / f"{name}.txt")]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def top_functions(collapsed: Path, n: int = 15) -> str:
    """The functions with the most samples in a py-spy raw (collapsed stacks) file: self and
    inclusive share of the samples."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = [f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].split(":")[0].rstrip(")")
                  for f in stack.split(";")]
        own[frames[-1]] = own.get(frames[-1], 0) + k
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + k
    if not total:
        return "  (no samples)"
    rows = sorted(own.items(), key=lambda kv: -kv[1])[:n]
    return "\n".join(f"  self {100 * k / total:5.1f}%  incl {100 * inclusive[f] / total:5.1f}%"
                     f"  {f}" for f, k in rows)


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def measure(router: str, proc: subprocess.Popen[bytes] | None, url: str, workload: str,
            concurrency: int, seconds: float, tokens: int, workers: list[int],
            prompts: list[str] | None = None, unique: bool = True, first: int = 0) -> Point:
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    gen = ctx.Process(target=generate, args=(url, workload, concurrency, seconds, tokens,
                                             prompts, unique, first, queue))
    cpu0, sys0 = cpu_times(proc.pid) if proc else (0.0, 0.0)
    workers0 = sum(cpu_seconds(pid) for pid in workers)
    t0 = time.monotonic()
    gen.start()
    requests, failed, chunks, latencies = queue.get(timeout=seconds + 900)
    wall = time.monotonic() - t0
    gen.join()
    cpu1, sys1 = cpu_times(proc.pid) if proc else (0.0, 0.0)
    cpu, sys_cpu = cpu1 - cpu0, sys1 - sys0
    workers_cpu = sum(cpu_seconds(pid) for pid in workers) - workers0
    lat = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    # The generator's start-up (a fresh interpreter) is in ``wall`` but sends nothing; the
    # requests' window is ``seconds`` plus the tail of the last ones.
    window = min(wall, seconds + float(np.nanmax(lat)) / 1000)
    return Point(router, workload, concurrency, window, requests, failed, chunks,
                 float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), cpu, workers_cpu,
                 sys_cpu)


def kind(router: str) -> str:
    """The router ``router`` names, from whichever checkout."""
    return router.removesuffix(BASE)


def kv_aware(router: str) -> bool:
    return kind(router) in KV_AWARE


def subscribes(router: str) -> bool:
    return kind(router).endswith(("-pub", "-rec"))


def router_name(name: str) -> str:
    if kind(name) not in ROUTERS or (name.endswith(BASE) and kind(name) in ("direct",
                                                                          "vllm-router")):
        raise argparse.ArgumentTypeError(
            f"{name!r}: one of {', '.join(ROUTERS)}, or an eldr one with {BASE}")
    return name


def measure_set(args: argparse.Namespace, routers: list[str], work: list[tuple[str, int]],
                paced: bool, publish: bool, home: Path,
                prompts: tuple[list[str] | None, float]) -> list[Point]:
    """Every point of ``routers`` on one set of fakes started for them. ``prompts``: the
    prompt texts (None: the short default ones) and their characters per token."""
    ctx = mp.get_context("spawn")
    ports = free_ports(args.prefill + args.decode + 1)
    batch_ports = free_ports(args.decode) if publish else None
    prefill = [f"http://127.0.0.1:{p}" for p in ports[:args.prefill]]
    decode = [f"http://127.0.0.1:{p}" for p in ports[args.prefill:-1]]
    batches = [f"tcp://127.0.0.1:{p}" for p in batch_ports or []]
    kv_events = ([f"tcp://127.0.0.1:{p}" for p in kv_event_ports(len(ports) - 1, ports)]
                 if any(kv_aware(r) for r in routers) else [])
    texts, chars_per_token = prompts
    kv_model = str(BUNDLED_MODELS_DIR / "tiny") if args.repeat_prompts else None
    fakes = [ctx.Process(target=serve_fakes, daemon=True,
                         args=(ports[:args.prefill], args.tokens, 0.0, None,
                               kv_events[:args.prefill], chars_per_token, kv_model,
                               args.kv_step_ms / 1000)),
             ctx.Process(target=serve_fakes, daemon=True,
                         args=(ports[args.prefill:-1], args.tokens,
                               args.pace_ms / 1000 if paced else 0.0, batch_ports,
                               kv_events[args.prefill:], chars_per_token, kv_model,
                               args.kv_step_ms / 1000))]
    points: list[Point] = []
    # Each point's new prompts start at a number of their own: the fakes' blocks (and their
    # first blocks' texts, which a KV-aware router reads) outlive a point, so a number sent
    # again would start like a held first block, and be encoded where a new one is not.
    numbers = itertools.count(0, PROMPT_NUMBERS)
    for f in fakes:
        f.start()
    fake_pids = [f.pid for f in fakes if f.pid is not None]
    try:
        for url in prefill + decode:
            wait_healthy(url, 60, lambda: None, interval_s=0.1)
        for round_, router in itertools.product(range(args.rounds), routers):
            port = ports[-1]
            proc = start_router(router, port, prefill, decode, batches, kv_events, home,
                                args.baseline)
            url = decode[0] if proc is None else f"http://127.0.0.1:{port}"
            try:
                if proc is not None:
                    wait_healthy(url, 120, proc.poll, interval_s=0.2)
                if kv_aware(router):
                    print(f"{router}: its KV view replayed the workers' history in"
                          f" {wait_kv_caught_up(url):.1f} s", flush=True)
                for workload, concurrency in work:
                    name = f"{router}-{workload}-{concurrency}" + (
                        f"-r{round_}" if args.rounds > 1 else "")
                    spy = start_profile(proc, router, args.profile, name, args.seconds)
                    point = measure(router, proc, url + "/v1/completions", workload,
                                    concurrency, args.seconds, args.tokens, fake_pids, texts,
                                    not args.repeat_prompts, next(numbers))
                    point = replace(point, round=round_)
                    points.append(point)
                    print(_row(point), flush=True)
                    if spy is not None:
                        spy.wait()
                        print(top_functions(args.profile / f"{name}.txt"), flush=True)
                if kv_aware(router):
                    print(kv_state(url, home / f"{router}-kv-state.json"), flush=True)
            finally:
                stop(proc)
            if kind(router).endswith("-rec"):
                from stages.signature.dataset import SignatureDataset

                print(f"{router}: {len(SignatureDataset.open(recorded(home, router)))} rows"
                      " recorded", flush=True)
    finally:
        for f in fakes:
            f.kill()
    return points


def kv_event_ports(count: int, avoid: list[int]) -> list[int]:
    """``count`` free ports each free with the next one too (its replay socket's)."""
    candidates = free_ports(4 * count + 4, avoid)
    free = set(candidates)
    chosen: list[int] = []
    for port in sorted(candidates):
        if len(chosen) < count and port + 1 in free and (not chosen or port > chosen[-1] + 1):
            chosen.append(port)
    if len(chosen) < count:
        raise SystemExit(f"only {len(chosen)} of {count} pairs of adjacent free ports")
    return chosen


def wait_kv_caught_up(url: str, timeout_s: float = 120.0, quiet_s: float = 2.5) -> float:
    """Seconds until a KV-aware router's view has applied what the idle fakes published before
    it started (their replay buffers: up to 10,000 batches each after other routers' points),
    so that start-up work is not counted as the first point's CPU per request."""
    from urllib.request import urlopen

    t0 = time.monotonic()
    seen: list[int] | None = None
    since = t0
    while time.monotonic() - t0 < timeout_s:
        with urlopen(url + "/admin/state", timeout=10) as r:
            kv = json.loads(r.read())["kv"]
        now = [w["events"] for role in ("prefill", "decode") for w in kv[role]]
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return since - t0
        time.sleep(0.1)
    raise SystemExit(f"the KV view of {url} was still applying events after {timeout_s:.0f} s")


def kv_state(url: str, out: Path) -> str:
    """What a KV-aware router's view held after its points (its /admin/state, written to
    ``out``) and the prompt tokens it routed by KV (its /metrics): proof it tokenized."""
    from urllib.request import urlopen

    with urlopen(url + "/admin/state", timeout=10) as r:
        state = json.loads(r.read())
    out.write_text(json.dumps(state, indent=1))
    with urlopen(url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    lines = [line for line in metrics.splitlines()
             if line.startswith(("eldr_kv_index_trusted", "eldr_kv_blocks",
                                 "eldr_kv_event_batches_total", "eldr_kv_event_gaps_total",
                                 "eldr_kv_event_lost_total", "eldr_kv_prompt_tokens_total",
                                 "eldr_kv_cached_tokens_total"))]
    return "\n".join(["  KV view (/metrics):", *(f"    {line}" for line in lines),
                      f"  /admin/state written to {out}"])


def long_prompts(tokens: int) -> tuple[list[str] | None, float]:
    """16 texts of about ``tokens`` tokens of the bundled model's tokenizer (None: the short
    default prompts), and their characters per token."""
    if tokens <= 0:
        return None, 4.0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODELS_DIR / "tiny")
    tok.model_max_length = 1 << 62  # only counting: no warning for a prompt past the model's
    words = ("the router reads each worker's cache of blocks and sends the request where its"
             " prompt is already held, or where the queue is short; experts decide the decode"
             " worker, the prefix decides the prefill worker.").split()
    texts = []
    for d in range(16):
        text, i = f"domain={d}:", d
        while len(tok.encode(text, add_special_tokens=False)) < tokens:
            text += " " + " ".join(words[(i + k) % len(words)] for k in range(40))
            i += 7
        ids = tok.encode(text, add_special_tokens=False)[:tokens]
        texts.append(tok.decode(ids))
    chars = sum(len(t) for t in texts) / sum(
        len(tok.encode(t, add_special_tokens=False)) for t in texts)
    return texts, chars


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), type=router_name,
                        metavar="ROUTER", help=f"of {', '.join(ROUTERS)}; NAME{BASE}: NAME"
                        " from the --baseline checkout")
    parser.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                        help="an eldr checkout (git worktree add DIR COMMIT) whose routers run"
                        f" as NAME{BASE}")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[64, 256, 1024])
    parser.add_argument("--seconds", type=float, default=15.0, help="per point")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--pace-ms", type=float, default=25.0)
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="every request's own prompt of about this many tokens (0: 16 short"
                        " prompts, repeated)")
    parser.add_argument("--repeat-prompts", action="store_true",
                        help="with --prompt-tokens: the same 16 prompts again and again (what a"
                        " worker holds hits: the fakes publish their real block hashes)")
    parser.add_argument("--kv-step-ms", type=float, default=0.0,
                        help="the fakes publish the KV events of the prompts they ran within"
                        " one engine step of this many ms as one batch, as vLLM does after each"
                        " step (0: one batch per prompt, as if every step ran one)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="the routers take turns this many times on the same fakes, each"
                        " started again a round; the summary gives each one's median CPU a"
                        " request over them, and the first router's capacity over each's"
                        " (this VM's figures move between minutes)")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench_proxy.json"))
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="sample eldr's routers with py-spy during every point")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if args.profile is not None and not Path(_tool("py-spy")).exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    if "vllm-router" in args.routers and not (
            shutil.which("vllm-router") or (Path(sys.executable).parent / "vllm-router").exists()):
        raise SystemExit("vllm-router is not installed: pip install vllm-router, or leave it"
                         " out with --routers direct eldr-union rr")
    if any(r.endswith(BASE) for r in args.routers) and (
            args.baseline is None or not (args.baseline / "eldr_cli").is_dir()):
        raise SystemExit(f"routers named NAME{BASE} need --baseline DIR, an eldr checkout"
                         f" (got {args.baseline})")

    home = Path(tempfile.mkdtemp(prefix="eldr-bench-proxy-"))
    points: list[Point] = []
    prompts = long_prompts(args.prompt_tokens)
    plan = [("plain", 1)] + [(w, c) for w in args.workloads for c in args.concurrency]
    # Paced and unpaced streams need differently behaving fakes, and only the routers that
    # subscribe to the decode workers' batches get fakes that publish them: publishing a
    # message per request costs a fake (GIL hand-offs to its publisher threads) what a vLLM
    # API server does not pay (its engine core publishes), and would slow "direct" and every
    # other router with it. One set of fakes for each.
    for paced in sorted({w == "paced" for w, _ in plan}):
        for publish in sorted({subscribes(r) for r in args.routers}):
            routers = [r for r in args.routers if subscribes(r) == publish]
            work = [(w, c) for w, c in plan if (w == "paced") == paced]
            points += measure_set(args, routers, work, paced, publish, home, prompts)
    args.out.write_text(json.dumps([{**asdict(p), "rps": p.rps, "chunks_per_s": p.chunks_per_s,
                                     "cores": p.cores,
                                     "cpu_ms_per_request": p.cpu_ms_per_request,
                                     "cpu_us_per_chunk": p.cpu_us_per_chunk,
                                     "sys_share": p.sys_share,
                                     "workers_cpu_ms_per_request":
                                         p.workers_cpu_ms_per_request}
                                    for p in points], indent=1))
    print(f"\n{_header()}")
    for p in sorted(points, key=lambda p: (p.workload, p.concurrency, ROUTERS.index(kind(p.router)),
                                               p.router)):
        print(_row(p))
    if args.rounds > 1:
        print(f"\n{summary(points, args.routers[0])}")
    print(f"written {args.out}; router logs in {home}")
    return 0


def summary(points: list[Point], reference: str) -> str:
    """Each router's median CPU a request over the rounds (lowest-highest), and the
    reference router's requests per CPU-second over its own (the capacity ratio)."""
    lines = [f"{'workload':>8} {'conc':>5} {'router':>16} {'rounds':>6} {'ms CPU/req, median':>19}"
             f" {'(lowest-highest)':>17} {f'req/CPU-s over {reference}':>28}"]
    cells: dict[tuple[str, int, str], list[float]] = {}
    for p in points:
        cells.setdefault((p.workload, p.concurrency, p.router), []).append(p.cpu_ms_per_request)
    for (workload, conc, router), cpu in cells.items():
        ref = cells.get((workload, conc, reference))
        ratio = f"{np.median(ref) / np.median(cpu):.2f}" if ref else "-"
        lines.append(f"{workload:>8} {conc:>5} {router:>16} {len(cpu):>6}"
                     f" {np.median(cpu):>19.3f} {f'({min(cpu):.2f}-{max(cpu):.2f})':>17}"
                     f" {ratio:>28}")
    return "\n".join(lines)


def _header() -> str:
    return (f"{'workload':>8} {'conc':>5} {'router':>12} {'req/s':>8} {'chunks/s':>9} "
            f"{'p50 ms':>8} {'p99 ms':>8} {'failed':>6} {'cores':>6} {'ms CPU/req':>10}"
            f" {'us CPU/chunk':>12} {'kernel':>6} {'workers ms/req':>14}")


def _row(p: Point) -> str:
    return (f"{p.workload:>8} {p.concurrency:>5} {p.router:>12} {p.rps:>8.0f} "
            f"{p.chunks_per_s:>9.0f} {p.latency_p50_ms:>8.2f} {p.latency_p99_ms:>8.1f} "
            f"{p.failed:>6} {p.cores:>6.2f} {p.cpu_ms_per_request:>10.2f}"
            f" {p.cpu_us_per_chunk:>12.1f} {p.sys_share:>6.0%}"
            f" {p.workers_cpu_ms_per_request:>14.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
