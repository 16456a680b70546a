"""NIXL's progress thread on CPU workers: idle CPU and request latency with it and without.

Starts `eldr serve --prefill 1 --decode 1 --policy rr` twice on the bundled model, once with
``ELDR_NIXL_PROGRESS_THREAD=1`` (NIXL's default, as plain vLLM runs) and once with ``0``
(eldr's default on CPU), in the same run; for each, the CPU time its processes use over 20
idle seconds, and the latency of 12 PD requests one after another (8 output tokens).

    .venv/bin/python -m examples.bench_nixl_progress
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from stages.procs import linux
from stages.procs.health import wait_healthy
from stages.serve.cluster.ports import free_ports


def cpu_seconds(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(progress_thread: str) -> tuple[float, float]:
    port, worker_port = free_ports(2)
    home = tempfile.mkdtemp(prefix="eldr-nixl-")
    env = {**os.environ, "ELDR_HOME": home, "ELDR_NIXL_PROGRESS_THREAD": progress_thread}
    proc = subprocess.Popen(
        [sys.executable, "-m", "eldr_cli", "serve", "--policy", "rr", "--prefill", "1",
         "--decode", "1", "--port", str(port), "--worker-port", str(worker_port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 900, proc.poll, interval_s=2)
        body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        time.sleep(5)
        pids = {i.pid for i in linux.descendants(proc.pid)} | {proc.pid}
        before, t0 = cpu_seconds(pids), time.monotonic()
        time.sleep(20)
        idle_cores = (cpu_seconds(pids) - before) / (time.monotonic() - t0)
        latencies = []
        for i in range(12):
            started = time.perf_counter()
            httpx.post(f"{url}/v1/completions", json={**body, "prompt": f"{i} {body['prompt']}"},
                       timeout=120).raise_for_status()
            latencies.append(time.perf_counter() - started)
        return idle_cores, statistics.median(latencies)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=180)


def main() -> None:
    rows = [(label, *measure(value)) for label, value in
            (("progress thread on (NIXL default)", "1"), ("progress thread off (eldr)", "0"))]
    print(f"{'workers':<36}{'idle CPU (cores)':>18}{'PD request p50 (ms)':>22}")
    for label, idle, latency in rows:
        print(f"{label:<36}{idle:>18.2f}{latency * 1e3:>22.1f}")


if __name__ == "__main__":
    main()
