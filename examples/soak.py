"""A soak of `eldr serve` on the bundled model: steady load for a bounded time, with a decode
worker killed every few minutes, a policy switch and an artifact switch on the way, then a
verdict on what was lost. Not part of CI (it runs for as long as you ask).

    .venv/bin/python -m examples.soak --minutes 20

Load: ``--clients`` closed-loop streaming clients (default 70% of the decode workers' batch
slots), each sending the bundled evaluation prompts back to back. Events: SIGKILL of a decode
worker's API server every ``--kill-every`` seconds (the supervisor restarts it), a policy
switch at a third of the run and back at two thirds, an artifact switch at half.

Verdict (exit 1 when it fails):
- every request ended: 200 with ``[DONE]``, or a stream that ended with an error event (a
  worker killed under it after tokens had reached the client: nothing else can be done);
- no request failed outright (a status other than 200) except within 10 s of a kill;
- at the end nothing is in flight, every worker is back, and the proxy's memory and open
  files grew by no more than ``--max-growth-mb`` and 64.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from stages.fit.artifact import ArtifactStore
from stages.paths import EVALUATION_PROMPTS
from stages.prompts import load_prompts
from stages.serve.cluster.ports import free_ports
from tests.proc_probe import api_server


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


def proxy_usage(pid: int) -> tuple[float, int]:
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--kill-every", type=float, default=300.0, help="seconds")
    parser.add_argument("--clients", type=int, default=11, help="70%% of 2 x 8 batch slots")
    parser.add_argument("--max-growth-mb", type=float, default=200.0)
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
        [sys.executable, "-m", "eldr_cli", "serve", "--policy", "eldr-union", "--port",
         str(port), "--worker-port", str(worker_port)],
        env=env, stdout=(home / "serve.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if serve.poll() is not None or time.monotonic() > deadline:
                print((home / "serve.log").read_text()[-3000:])
                return 1
            time.sleep(2)
        prompts = [p.prompt for p in load_prompts(EVALUATION_PROMPTS)]
        outcomes: list[Outcome] = []
        stop = threading.Event()
        threads = [threading.Thread(target=client_loop, args=(url, prompts, stop, c, outcomes))
                   for c in range(args.clients)]
        start_usage = proxy_usage(serve.pid)
        t0 = time.monotonic()
        for t in threads:
            t.start()
        duration = args.minutes * 60
        events: list[tuple[float, str]] = []
        next_kill, victim = args.kill_every, 0
        switched: set[str] = set()
        while (now := time.monotonic() - t0) < duration:
            if now >= next_kill:
                pid = api_server(serve.pid, worker_port + 1 + victim)
                os.kill(pid, signal.SIGKILL)
                events.append((now, f"SIGKILL decode-{victim}"))
                next_kill += args.kill_every
                victim = 1 - victim
            for at, name, action in ((1 / 3, "jsq", "policy"), (1 / 2, "artifact", "artifact"),
                                     (2 / 3, "eldr-union", "policy")):
                if now >= at * duration and name not in switched:
                    switched.add(name)
                    if action == "policy":
                        r = httpx.post(f"{url}/admin/policy", json={"policy": name}, timeout=10)
                    else:
                        r = httpx.post(f"{url}/admin/artifact", json={"version": first},
                                       timeout=10)
                    target = first if action == "artifact" else name
                    events.append((now, f"{action} -> {target} ({r.status_code})"))
            time.sleep(1)
        stop.set()
        for t in threads:
            t.join(timeout=300)
        end_usage = proxy_usage(serve.pid)
        time.sleep(3)
        state = httpx.get(f"{url}/admin/state", timeout=10).json()
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=180)

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
        "proxy RSS MB start/end": f"{start_usage[0]:.0f}/{end_usage[0]:.0f}",
        "proxy open files start/end": f"{start_usage[1]}/{end_usage[1]}",
    }
    for at, what in events:
        print(f"  {at:7.0f} s  {what}")
    for key, value in checks.items():
        print(f"{key:>40}: {value}")
    ok = (not unexplained and checks["in flight at the end"] == 0
          and all(w["healthy"] for w in workers)
          and end_usage[0] - start_usage[0] <= args.max_growth_mb
          and end_usage[1] - start_usage[1] <= 64)
    (home / "soak.json").write_text(json.dumps(
        {"checks": checks, "events": events, "ok": ok,
         "outcomes": [asdict(o) for o in outcomes[:20000]]}, indent=1))
    print(f"soak {'passed' if ok else 'FAILED'}; details in {home / 'soak.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
