"""A soak of `eldr serve` on the bundled model: steady load for a bounded time, with a decode
worker killed every few minutes, a policy switch and an artifact switch on the way, then a
verdict on what was lost. Not part of CI (it runs for as long as you ask).

    .venv/bin/python -m examples.soak --minutes 20 --kill-every 240 --fuzz-examples 200

Load: ``--clients`` closed-loop streaming clients (default 70% of the decode workers' batch
slots), each sending the bundled evaluation prompts back to back. Events: SIGKILL of a decode
worker's API server every ``--kill-every`` seconds (the supervisor restarts it), a policy
switch from the default (eldr-kv, KV-aware: the workers publish their KV events to the proxy)
to ``--switch-to`` at a third of the run and back at two thirds, an artifact switch at half.

Verdict (exit 1 when it fails):
- every request ended: 200 with ``[DONE]``, or a stream that ended with an error event (a
  worker killed under it after tokens had reached the client: nothing else can be done);
- no request failed outright (a status other than 200) except within 10 s of a kill;
- at the end nothing is in flight and every worker is back;
- after warm-up (``--warmup`` seconds of load, or of a restarted worker's life), the memory
  (RSS of its process tree) and open files of the proxy and of each worker grew by at most
  ``--max-growth`` (5%) to the end. A worker restarted less than a warm-up before the end has
  no baseline and is reported as such;
- over the last ``--window`` seconds (10 minutes), the proxy's memory and open files grew by
  at most ``--max-growth`` from the window's first sample to its last (reported, with the
  range and the medians of the window's halves, for every process that lived through it);
- each switch, policy or artifact, took (the proxy's state then names what was asked for).

With ``--fuzz-examples N`` it then fuzzes the live proxy (examples/fuzz_proxy.py: N requests per
route generated from vLLM's OpenAPI schema, sent to the proxy and to a decode worker) before
shutting down, and fails on a 5xx from the proxy or a 4xx not in vLLM's error shape.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from examples.fuzz_proxy import fuzz
from stages.errors import EldrError
from stages.fit.artifact import ArtifactStore
from stages.paths import EVALUATION_PROMPTS
from stages.procs import linux
from stages.procs.health import wait_healthy
from stages.prompts import load_prompts
from stages.serve.cluster.ports import free_ports
from tests.proc_probe import api_server

DEFAULT_POLICY = "eldr-kv"  # `eldr serve`'s default


@dataclass
class Outcome:
    started: float
    ended: float
    status: int
    complete: bool  # [DONE] without an error event
    cut: bool  # a stream that ended with an error event


def eldr(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "eldr_cli", *args], env=env, check=True,
                   stdout=subprocess.DEVNULL)


def client_loop(url: str, prompts: list[str], stop: threading.Event, seed: int,
                out: list[Outcome]) -> None:
    i = seed
    with httpx.Client(timeout=300) as http:
        while not stop.is_set():
            body = {"model": "tiny", "prompt": prompts[i % len(prompts)], "max_tokens": 32,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            started = time.monotonic()
            status, complete, cut = -1, False, False
            try:
                with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                    status = response.status_code
                    text = "".join(response.iter_text())
                complete = status == 200 and text.rstrip().endswith("data: [DONE]") \
                    and '"error"' not in text
                cut = status == 200 and '"error"' in text
            except httpx.HTTPError:
                pass
            out.append(Outcome(started, time.monotonic(), status, complete, cut))
            i += 97


@dataclass(frozen=True)
class Usage:
    at: float  # seconds into the load
    name: str  # "proxy" or a worker's name
    pid: int
    rss_mb: float  # the process and its descendants (a vLLM worker's engine core)
    fds: int


def usage(at: float, name: str, pid: int, tree: bool = True) -> Usage:
    pids = [pid, *(i.pid for i in linux.descendants(pid) if not i.zombie and tree)]
    rss_kb = fds = 0
    for p in pids:
        try:
            rss_kb += next(int(line.split()[1]) for line in Path(f"/proc/{p}/status")
                           .read_text().splitlines() if line.startswith("VmRSS:"))
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone between the listing and the read (a kill)
    return Usage(at, name, pid, rss_kb / 1024, fds)


def sample(at: float, serve_pid: int, ports: dict[str, int]) -> list[Usage]:
    """The proxy (the ``eldr serve`` process alone: the workers are its descendants) and every
    worker's API server tree, by port."""
    out = [usage(at, "proxy", serve_pid, tree=False)]
    for name, port in ports.items():
        try:
            out.append(usage(at, name, api_server(serve_pid, port)))
        except AssertionError:
            pass  # restarting after a kill: no API server on its port this moment
    return out


def window_growth(samples: list[Usage], window_s: float) -> dict[str, dict[str, object]]:
    """Per process that ran through the last ``window_s`` seconds (the same pid from its first
    sample to the end): the first sample in that window against the last, the range of every
    sample in it, and the median of its first half against its second's (open files move with
    the connections open at the moment a sample is taken; a leak moves the median)."""
    end = samples[-1].at
    out: dict[str, dict[str, object]] = {}
    for name in dict.fromkeys(u.name for u in samples):
        mine = [u for u in samples if u.name == name]
        last = mine[-1]
        inside = [u for u in mine if u.at >= end - window_s]
        if min(u.at for u in mine if u.pid == last.pid) > end - window_s or len(inside) < 2 \
                or any(u.pid != last.pid for u in inside):
            out[name] = {"pid": last.pid, "note": "restarted within the window: no baseline"}
            continue
        base = inside[0]
        rss = [u.rss_mb for u in inside]
        fds = [u.fds for u in inside]
        out[name] = {"pid": last.pid, "from_s": round(base.at), "samples": len(inside),
                     "rss_mb": f"{base.rss_mb:.0f} -> {last.rss_mb:.0f}",
                     "fds": f"{base.fds} -> {last.fds}",
                     "rss_range_mb": f"{min(rss):.0f}-{max(rss):.0f}",
                     "fds_range": f"{min(fds)}-{max(fds)}",
                     "rss_growth": last.rss_mb / base.rss_mb - 1,
                     "fds_growth": last.fds / base.fds - 1,
                     "rss_halves_mb": f"{_halves(rss)[0]:.0f} -> {_halves(rss)[1]:.0f}",
                     "fds_halves": "{:g} -> {:g}".format(*_halves(fds))}
    return out


def _halves(values: list[float] | list[int]) -> tuple[float, float]:
    half = len(values) // 2
    return statistics.median(values[:half]), statistics.median(values[half:])


def growth(samples: list[Usage], warmup_s: float) -> dict[str, dict[str, object]]:
    """Per process: the first sample at least ``warmup_s`` into the load and into the life
    of the process that runs at the end, against the last sample."""
    out: dict[str, dict[str, object]] = {}
    for name in dict.fromkeys(u.name for u in samples):
        mine = [u for u in samples if u.name == name]
        last = mine[-1]
        born = min(u.at for u in mine if u.pid == last.pid)
        after = [u for u in mine if u.pid == last.pid and u.at >= max(warmup_s, born + warmup_s)]
        if not after or after[0] is last:
            out[name] = {"pid": last.pid, "note": f"restarted at {born:.0f} s: no baseline"}
            continue
        base = after[0]
        out[name] = {"pid": last.pid, "from_s": round(base.at),
                     "rss_mb": f"{base.rss_mb:.0f} -> {last.rss_mb:.0f}",
                     "fds": f"{base.fds} -> {last.fds}",
                     "rss_growth": last.rss_mb / base.rss_mb - 1,
                     "fds_growth": last.fds / base.fds - 1}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--kill-every", type=float, default=240.0, help="seconds")
    parser.add_argument("--clients", type=int, default=11, help="70%% of 2 x 8 batch slots")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds")
    parser.add_argument("--max-growth", type=float, default=0.05, help="fraction")
    parser.add_argument("--window", type=float, default=600.0,
                        help="seconds at the end over which the proxy must stay flat")
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds")
    parser.add_argument("--switch-to", default="eldr-union",
                        help=f"the policy switched to from {DEFAULT_POLICY} and back")
    parser.add_argument("--fuzz-examples", type=int, default=0,
                        help="schema-fuzzed requests per route after the load (0: none)")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="eldr-soak-"))
    env = {**os.environ, "ELDR_HOME": str(home)}
    print(f"soak in {home}: capture and two fits first", flush=True)
    eldr("capture", "--limit", "200", "--max-tokens", "16", env=env)
    eldr("fit", "--k", "2", "--balanced", "--no-plot", "--seed", "1", env=env)
    first = ArtifactStore(home / "artifacts").resolve("latest")
    eldr("fit", "--k", "2", "--balanced", "--no-plot", "--seed", "2", env=env)
    port, worker_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [sys.executable, "-m", "eldr_cli", "serve", "--policy", DEFAULT_POLICY, "--port",
         str(port), "--worker-port", str(worker_port)],
        env=env, stdout=(home / "serve.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        try:
            wait_healthy(url, 900, serve.poll, interval_s=2)
        except EldrError as e:
            print(f"{e}\n{(home / 'serve.log').read_text()[-3000:]}")
            return 1
        state = httpx.get(f"{url}/admin/state", timeout=10).json()
        ports = {f"{role}-{w['index']}": int(w["url"].rsplit(":", 1)[1])
                 for role in ("prefill", "decode") for w in state[f"{role}_workers"]}
        prompts = [p.prompt for p in load_prompts(EVALUATION_PROMPTS)]
        outcomes: list[Outcome] = []
        stop = threading.Event()
        threads = [threading.Thread(target=client_loop, args=(url, prompts, stop, c, outcomes))
                   for c in range(args.clients)]
        t0 = time.monotonic()
        samples = sample(0.0, serve.pid, ports)
        next_sample = args.sample_every
        for t in threads:
            t.start()
        duration = args.minutes * 60
        events: list[tuple[float, str]] = []
        next_kill, victim = args.kill_every, 0
        switched: set[str] = set()
        switches: list[bool] = []
        while (now := time.monotonic() - t0) < duration:
            if now >= next_sample:
                samples += sample(now, serve.pid, ports)
                next_sample += args.sample_every
            if now >= next_kill:
                pid = api_server(serve.pid, ports[f"decode-{victim}"])
                os.kill(pid, signal.SIGKILL)
                events.append((now, f"SIGKILL decode-{victim}"))
                next_kill += args.kill_every
                victim = 1 - victim
            for at, name, action in ((1 / 3, args.switch_to, "policy"),
                                     (1 / 2, "artifact", "artifact"),
                                     (2 / 3, DEFAULT_POLICY, "policy")):
                if now >= at * duration and name not in switched:
                    switched.add(name)
                    if action == "policy":
                        r = httpx.post(f"{url}/admin/policy", json={"policy": name}, timeout=10)
                    else:
                        r = httpx.post(f"{url}/admin/artifact", json={"version": first},
                                       timeout=10)
                    target = first if action == "artifact" else name
                    key = "policy" if action == "policy" else "artifact_version"
                    took = httpx.get(f"{url}/admin/state", timeout=10).json()[key]
                    events.append((now, f"{action} -> {target} ({r.status_code}, now {took})"))
                    switches.append(r.status_code == 200 and took == target)
            time.sleep(1)
        stop.set()
        for t in threads:
            t.join(timeout=300)
        samples += sample(time.monotonic() - t0, serve.pid, ports)
        time.sleep(3)
        state = httpx.get(f"{url}/admin/state", timeout=10).json()
        # The verdict first, so a fuzzing failure cannot take the soak's figures with it.
        ok = verdict(args, home, t0, events, switches, outcomes, samples, state)
        healthy = [w["url"] for w in state["decode_workers"] if w["healthy"]]
        if args.fuzz_examples and not healthy:
            print("no decode worker up at the end: no fuzzing")
            return 1
        fuzzed = fuzz(url, healthy[0], "tiny", args.fuzz_examples) if args.fuzz_examples \
            else None
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=180)
    if fuzzed is not None:
        print(f"schema fuzzing, {args.fuzz_examples} examples per route, after the load:")
        print("\n".join(f"  {line}" for line in fuzzed.lines()))
        print(f"fuzz {'passed' if fuzzed.ok else 'FAILED'}")
        (home / "fuzz.txt").write_text("\n".join(fuzzed.lines()) + "\n")
    return 0 if ok and (fuzzed is None or fuzzed.ok) else 1


def verdict(args: argparse.Namespace, home: Path, t0: float, events: list[tuple[float, str]],
            switches: list[bool], outcomes: list[Outcome], samples: list[Usage],
            state: dict[str, Any]) -> bool:
    """Print the figures, write them to soak.json, and say whether the soak passed."""
    kills = [at for at, what in events if what.startswith("SIGKILL")]
    near_kill = [o for o in outcomes
                 if any(k - 1 <= o.started - t0 <= k + 10 or k - 1 <= o.ended - t0 <= k + 10
                        for k in kills)]
    failed = [o for o in outcomes if not o.complete and not o.cut]
    unexplained = [o for o in failed if o not in near_kill]
    workers = state["decode_workers"] + state["prefill_workers"]
    checks = {
        "requests": len(outcomes),
        "complete": sum(o.complete for o in outcomes),
        "cut mid-stream by a kill (error event)": sum(o.cut for o in outcomes),
        "failed within 10 s of a kill": len(failed) - len(unexplained),
        "failed otherwise": len(unexplained),
        "in flight at the end": sum(w["in_flight"] for w in workers),
        "workers back": f"{sum(w['healthy'] for w in workers)} of {len(workers)}",
    }
    grown = growth(samples, args.warmup)
    window = window_growth(samples, args.window)
    for at, what in events:
        print(f"  {at:7.0f} s  {what}")
    for key, value in checks.items():
        print(f"{key:>40}: {value}")
    # KV-aware routing ran on the workers' KV events (eldr-kv): what the proxy was told.
    for role in ("prefill", "decode"):
        for w, kv in enumerate((state["kv"] or {}).get(role, [])):
            print(f"{f'KV events from {role}-{w}':>40}: {kv}")
    print(f"over the last {args.window:.0f} s (first sample in it -> last; range;"
          " median of its first half -> second half):")
    for name, g in window.items():
        if "note" in g:
            print(f"{name:>12} (pid {g['pid']}): {g['note']}")
        else:
            print(f"{name:>12} (pid {g['pid']}, from {g['from_s']} s, {g['samples']} samples):"
                  f" RSS MB {g['rss_mb']} ({g['rss_growth']:+.1%}; {g['rss_range_mb']};"
                  f" {g['rss_halves_mb']}), open files {g['fds']} ({g['fds_growth']:+.1%};"
                  f" {g['fds_range']}; {g['fds_halves']})")
    print(f"after {args.warmup:.0f} s of warm-up, to the end (RSS of the process tree, files):")
    for name, g in grown.items():
        if "note" in g:
            print(f"{name:>12} (pid {g['pid']}): {g['note']}")
        else:
            print(f"{name:>12} (pid {g['pid']}, from {g['from_s']} s): RSS MB {g['rss_mb']}"
                  f" ({g['rss_growth']:+.1%}), open files {g['fds']} ({g['fds_growth']:+.1%})")
    flat = all(g.get("rss_growth", 0) <= args.max_growth and g.get("fds_growth", 0)
               <= args.max_growth for g in grown.values())
    proxy_flat = "note" not in window["proxy"] and all(
        window["proxy"][k] <= args.max_growth for k in ("rss_growth", "fds_growth"))
    ok = (not unexplained and checks["in flight at the end"] == 0
          and all(w["healthy"] for w in workers) and flat and "note" not in grown["proxy"]
          and proxy_flat and len(switches) == 3 and all(switches))
    (home / "soak.json").write_text(json.dumps(
        {"checks": checks, "events": events, "ok": ok, "growth": grown, "window": window,
         "samples": [asdict(u) for u in samples],
         "outcomes": [asdict(o) for o in outcomes[:20000]]}, indent=1))
    print(f"soak {'passed' if ok else 'FAILED'}; details in {home / 'soak.json'}", flush=True)
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
