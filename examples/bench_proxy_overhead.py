"""Latency the ELDR proxy adds to a PD request, against fake vLLM workers on real sockets.

Three processes serve HTTP with uvicorn exactly as in production (uvloop, httptools): a fake
prefill worker, a fake decode worker listening on 16 ports (16 distinct decode URLs, so ELDR
routes among K=16 centroids), and the proxy started through ``run_proxy`` with policy eldr and
Qwen3-30B-shaped 48x128 signatures. One client sends requests one at a time:

* direct: the client itself runs both PD legs (prefill request, then the decode request with
  the returned ``kv_transfer_params``), i.e. what a zero-cost router would cost;
* proxy: the same request through the proxy.

Added latency = median(proxy) - median(direct); the goal is <= 1 ms. The fakes answer at
once, so the figure is the proxy's own cost (extra hop, JSON, signature decode, routing). The
proxy process's CPU time per request is printed too: on a shared machine it is the steadier
figure, since latency also counts the waits for a core that other tenants hold.
The real-vLLM variant of this measurement (NixlConnector PD on the tiny MoE) is run by the
lead, not here.

    python -m examples.bench_proxy_overhead [--requests 400] [--tokens 16]   # from the repo root
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import re
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

from stages.procs.health import wait_healthy
from stages.serve.proxy.config import ProxyConfig
from stages.serve.proxy.front.request import decode_body, prefill_body
from stages.signature.dataset import ModelIdentity

try:
    # The fake workers are the tests' doubles, importable when the repo root is on sys.path.
    from tests.fakes.artifact import domain_artifact
    from tests.fakes.worker import FakeBehavior, create_fake_worker, domain_signature
except ModuleNotFoundError as exc:
    if exc.name != "tests":
        raise
    raise SystemExit(
        f"{exc}: run from the repo root as `python -m examples.bench_proxy_overhead`"
    ) from exc

K = 16
SHAPE = (48, 128)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def serve_fake(ports: list[int]) -> None:
    import uvicorn

    signature = functools.partial(domain_signature, shape=SHAPE)
    app = create_fake_worker(FakeBehavior("bench", signature=signature))
    socks = []
    for port in ports:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        socks.append(s)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=socks)


def bench_artifact(root: Path, version: str):
    return domain_artifact(K, ModelIdentity("bench-moe", *SHAPE, top_k=8), version)


def serve_proxy(config: ProxyConfig, port: int) -> None:
    from stages.serve.proxy import run_proxy

    run_proxy(config, port=port, log_level="warning", artifact_loader=bench_artifact)


def read_stream(response: httpx.Response, t0: float) -> float:
    """Read an SSE response to the end; return the time of its first byte."""
    first = None
    for _ in response.iter_raw():
        if first is None:
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def run_direct(client: httpx.Client, prefill: str, decode: str, body: dict) -> tuple[float, float]:
    """Both PD legs from the client itself: (total, first byte) seconds."""
    t0 = time.perf_counter()
    pre = client.post(prefill + "/v1/completions", content=orjson.dumps(prefill_body(body, False)))
    payload = orjson.dumps(decode_body(body, orjson.loads(pre.content)["kv_transfer_params"]))
    if body["stream"]:
        with client.stream("POST", decode + "/v1/completions", content=payload) as r:
            first = read_stream(r, t0)
    else:
        client.post(decode + "/v1/completions", content=payload).raise_for_status()
        first = time.perf_counter() - t0
    return time.perf_counter() - t0, first


def run_proxied(client: httpx.Client, proxy: str, body: dict) -> tuple[float, float]:
    t0 = time.perf_counter()
    if body["stream"]:
        with client.stream("POST", proxy + "/v1/completions", content=orjson.dumps(body)) as r:
            r.raise_for_status()
            first = read_stream(r, t0)
    else:
        client.post(proxy + "/v1/completions", content=orjson.dumps(body)).raise_for_status()
        first = time.perf_counter() - t0
    return time.perf_counter() - t0, first


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (Linux /proc), contention-independent cost."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ms(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="per mode and stream setting")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens per request")
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    ports = free_ports(2 + K)
    prefill_url = f"http://127.0.0.1:{ports[0]}"
    decode_urls = [f"http://127.0.0.1:{p}" for p in ports[1 : 1 + K]]
    proxy_url = f"http://127.0.0.1:{ports[-1]}"
    config = ProxyConfig(
        prefill_urls=(prefill_url,),
        decode_urls=tuple(decode_urls),
        policy="eldr",
        artifact_store=Path("/bench"),
        model="fake-model",
    )
    procs = [
        ctx.Process(target=serve_fake, args=([ports[0]],), daemon=True),
        ctx.Process(target=serve_fake, args=(ports[1 : 1 + K],), daemon=True),
        ctx.Process(target=serve_proxy, args=(config, ports[-1]), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        for url in (prefill_url, decode_urls[0], proxy_url):
            wait_healthy(url, 60, lambda: next((p.exitcode for p in procs if not p.is_alive()),
                                                None), interval_s=0.1)
        load_before = os.getloadavg()[0]
        print(
            f"proxy overhead: fake PD workers, ELDR over K={K} decode urls, signatures"
            f" {SHAPE[0]}x{SHAPE[1]}, {args.tokens} tokens, {args.requests} sequential requests"
            " per row, direct and proxied alternating"
        )
        # The proxy, as vLLM, takes only bodies declared application/json.
        with httpx.Client(timeout=30, headers={"content-type": "application/json"}) as client:
            for stream in (False, True):
                bodies = [
                    {
                        "model": "fake-model",
                        "prompt": f"domain={i % K} " + "word " * 200,
                        "max_tokens": args.tokens,
                        "stream": stream,
                    }
                    for i in range(args.requests)
                ]
                for body in bodies[:50]:  # warm connections and code paths
                    run_direct(client, prefill_url, decode_urls[0], body)
                    run_proxied(client, proxy_url, body)
                direct, proxied = [], []
                cpu0 = cpu_seconds(procs[2].pid)
                for i, body in enumerate(bodies):
                    # Alternate so drift in a shared machine's load hits both sides alike.
                    direct.append(run_direct(client, prefill_url, decode_urls[i % K], body))
                    proxied.append(run_proxied(client, proxy_url, body))
                cpu_ms = (cpu_seconds(procs[2].pid) - cpu0) / len(bodies) * 1e3
                d, p = np.array(direct), np.array(proxied)
                label = "stream    " if stream else "non-stream"
                print(
                    f"  {label} total    : direct p50 {ms(d[:, 0], 50):6.3f} ms"
                    f"  proxy p50 {ms(p[:, 0], 50):6.3f} ms"
                    f"  added p50 {ms(p[:, 0], 50) - ms(d[:, 0], 50):6.3f} ms"
                    f"  (p90 added {ms(p[:, 0], 90) - ms(d[:, 0], 90):6.3f} ms)"
                )
                if stream:
                    print(
                        f"  {label} 1st byte : direct p50 {ms(d[:, 1], 50):6.3f} ms"
                        f"  proxy p50 {ms(p[:, 1], 50):6.3f} ms"
                        f"  added p50 {ms(p[:, 1], 50) - ms(d[:, 1], 50):6.3f} ms"
                    )
                print(f"  {label} proxy CPU: {cpu_ms:.3f} ms per request (user + system)")
            metrics = client.get(proxy_url + "/metrics").text
        total = re.search(r"^eldr_router_decision_seconds_sum (\S+)$", metrics, re.M)
        count = re.search(r"^eldr_router_decision_seconds_count (\S+)$", metrics, re.M)
        if total and count and float(count.group(1)):
            mean_us = float(total.group(1)) / float(count.group(1)) * 1e6
            print(
                f"  routing in the proxy (wire decode + transform + choose): mean {mean_us:.0f} us"
            )
        print(
            f"  machine: {os.cpu_count()} CPUs, load average {load_before:.2f} before and"
            f" {os.getloadavg()[0]:.2f} after (other tenants inflate every figure)"
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(10)


if __name__ == "__main__":
    main()
