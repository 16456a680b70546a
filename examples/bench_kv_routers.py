"""KV-aware routing side by side with vllm-router, on the same live vLLM workers, in one run.

Starts ``eldr serve`` (``--prefill 2 --decode 2`` eager workers of the bundled model by
default: the workers publish vLLM's KV events to the proxy), then vllm-router in PD mode on
the very same workers, and runs ``eldr bench --workload conversations``: eldr's policies (by
its admin API) and vllm-router take turns each round, every one on fresh conversations (a
prefix cache outlives a run). The table it prints carries, per router, the prefill workers'
prefix-hit share from their own ``vllm:prefix_cache_*`` counters against the ideal (every turn
on the worker holding its history), the KV tokens the decode workers pulled, and TTFT per turn
and TPOT with their round-to-round spread.

vllm-router is the Rust router from PyPI (``pip install vllm-router``; give its path with
``--vllm-router``). Its ``kv_aware`` policy needs KV events at block size 16 in PD mode, which
vLLM's CPU attention cannot use (multiples of 32), so on CPU workers its best configuration
that runs is ``cache_aware`` (an approximate prefix tree) on both legs: ``--vllm-router-policy``
picks another, ``--vllm-router-decode-policy`` another for the decode leg. Nor can its
``kv_aware`` run on the decode leg alone: 0.1.17 refuses static ``--kv-event-source`` in PD mode
("only supported in regular mode").

    python -m examples.bench_kv_routers                      # about 15 min on 2 cores
    python -m examples.bench_kv_routers --rounds 2 --conversations 6 --policies eldr-kv

Configurations of one policy as rows of their own (``eldr bench --variant``): eldr-kv
choosing the decode worker at arrival, and a decode worker prefilling what it lacks itself
below 256 tokens, beside eldr-kv's defaults and a load balancer. The decode choice at arrival
needs an artifact with a token predictor: ``--capture N`` captures N calibration prompts and
fits one centroid per decode worker first (several minutes on CPU), or ``--home`` names an
ELDR_HOME that holds one (a ``signatures.zarr`` there and no artifact: it is fitted).

    python -m examples.bench_kv_routers --no-vllm-router --capture 400 --policies eldr-kv,jsq \
        --variant 'arrival=eldr-kv:{"decode_choice": "arrival"}' \
        --variant 'local-256=eldr-kv:{"local_prefill_below": 256}'

eldr's policies price workers with a cost model; without one they take the GPU-like preset,
whose ratios (a decode step against a prefill token, a KV pull, an expert) are not those of
CPU workers. ``--engine-cost`` measures the served workers first (``eldr bench --engine-cost``,
~4 min; it needs an artifact for the model's layer count: ``--capture N`` or ``--home``) and
gives every eldr policy that model (``cost``), as a user would who measured their engine;
``--home`` keeps it (``cost-model.json``) for the next run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from stages.serve.cluster.ports import free_ports


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{what} not healthy after {timeout_s:.0f} s")


@contextmanager
def _running(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[
        subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def find_vllm_router() -> str | None:
    """The vllm-router on PATH, else the one `pip install vllm-router` put beside this Python
    (a venv used without activating it)."""
    beside = Path(sys.executable).with_name("vllm-router")
    return shutil.which("vllm-router") or (str(beside) if beside.exists() else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--policies", default="eldr-kv,eldr-union",
                    help="eldr's policies to bench, comma separated")
    ap.add_argument("--vllm-router", default=find_vllm_router(),
                    help="the vllm-router executable (pip install vllm-router)")
    ap.add_argument("--no-vllm-router", action="store_true",
                    help="bench eldr's policies and variants alone")
    ap.add_argument("--vllm-router-policy", default="cache_aware",
                    help="vllm-router's policy (its prefill leg's, with a decode policy)")
    ap.add_argument("--vllm-router-decode-policy", default=None,
                    help="vllm-router's decode leg's policy (default: --vllm-router-policy)")
    ap.add_argument("--variant", action="append", default=[],
                    help="a row of an eldr policy with its own options, LABEL=POLICY:JSON, as"
                    " `eldr bench --variant` takes it (repeatable)")
    ap.add_argument("--capture", type=int, default=0,
                    help="capture this many calibration prompts and fit an artifact (one"
                    " centroid per decode worker, with its token predictor) before serving")
    ap.add_argument("--home", type=Path, default=None,
                    help="the ELDR_HOME to serve from (default: a new temporary one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-concurrency", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--think-time", type=float, default=1.0)
    ap.add_argument("--policy-config", default=None,
                    help="eldr's policy options, as `eldr bench --policy-config` takes them"
                    """ (e.g. '{"eldr-kv": {"cost": "cpu"}}' on CPU workers)""")
    ap.add_argument("--engine-cost", action="store_true",
                    help="measure the served workers' costs first (or reuse the home's"
                    " cost-model.json) and price eldr's policies with them")
    ap.add_argument("--result-dir", type=Path, default=Path("results/kv-routers"))
    args = ap.parse_args()
    use_router = not args.no_vllm_router
    if use_router and (not args.vllm_router or not Path(args.vllm_router).exists()):
        raise SystemExit("vllm-router not found: pip install vllm-router, give --vllm-router,"
                         " or bench without it (--no-vllm-router)")

    eldr = [sys.executable, "-m", "eldr_cli"]
    home = args.home or Path(tempfile.mkdtemp(prefix="eldr-kv-routers-"))
    env = {**os.environ, "ELDR_HOME": str(home)}
    _calibrate(eldr, env, home, args.model, args.capture, args.decode)
    proxy_port, router_port, worker_port = free_ports(3)
    proxy = f"http://127.0.0.1:{proxy_port}"
    router = f"http://127.0.0.1:{router_port}"
    serve = [*eldr, "serve", "--model", args.model, "--prefill", str(args.prefill),
             "--decode", str(args.decode), "--enforce-eager", "--policy", "eldr-kv",
             "--port", str(proxy_port), "--worker-port", str(worker_port)]
    print(f"starting {' '.join(serve[2:])} (logs in {home})", flush=True)
    with _running(serve, home / "serve.log", env) as served:
        _wait_healthy(proxy, served, "eldr serve", 900)
        state = httpx.get(f"{proxy}/admin/state", timeout=10).json()
        prefill = [w["url"] for w in state["prefill_workers"]]
        decode = [w["url"] for w in state["decode_workers"]]
        bench = [*eldr, "bench", "--url", proxy, "--policies", args.policies,
                 "--workload", "conversations",
                 "--turns", str(args.turns), "--conversations", str(args.conversations),
                 "--rounds", str(args.rounds), "--max-concurrency",
                 str(args.max_concurrency), "--max-tokens", str(args.max_tokens),
                 "--think-time", str(args.think_time),
                 "--prefill-urls", ",".join(prefill), "--decode-urls", ",".join(decode),
                 "--result-dir", str(args.result_dir)]
        for variant in args.variant:
            bench += ["--variant", variant]
        policy_config = args.policy_config
        if args.engine_cost:
            policy_config = _priced_by(_engine_cost(eldr, env, home, proxy), policy_config,
                                       args.policies, args.variant)
        if policy_config:
            bench += ["--policy-config", policy_config]
        if not use_router:
            print(" ".join(bench[2:]), flush=True)
            subprocess.run(bench, env=env, check=True)
            return
        argv = [args.vllm_router, "--vllm-pd-disaggregation", "--host", "127.0.0.1",
                "--port", str(router_port)]
        argv += _vllm_router_policies(args.vllm_router_policy, args.vllm_router_decode_policy)
        for url in prefill:
            argv += ["--prefill", url]
        for url in decode:
            argv += ["--decode", url]
        print(" ".join(argv), flush=True)
        with _running(argv, home / "vllm-router.log") as routed:
            _wait_healthy(router, routed, "vllm-router", 60)
            name = f"vllm-router-{args.vllm_router_policy.replace('_', '-')}"
            if args.vllm_router_decode_policy:
                name += f"-{args.vllm_router_decode_policy.replace('_', '-')}"
            bench += ["--router", f"{name}={router}"]
            print(" ".join(bench[2:]), flush=True)
            subprocess.run(bench, env=env, check=True)


def _vllm_router_policies(policy: str, decode_policy: str | None) -> list[str]:
    """vllm-router's policy flags: ``policy`` on both legs, or on prefill beside
    ``decode_policy``. Its ``kv_aware`` cannot be one of them on CPU workers in PD mode (the
    module's docstring)."""
    if "kv_aware" in (policy, decode_policy):
        raise SystemExit("vllm-router 0.1.17 runs kv_aware in PD mode only from the prefill"
                         " workers' events at block size 16 (--pd-kv-events), which vLLM's CPU"
                         " attention cannot use, and refuses the decode workers' events"
                         " (--kv-event-source is for its regular mode only)")
    return ["--policy", policy] + (["--decode-policy", decode_policy] if decode_policy else [])


def _engine_cost(eldr: list[str], env: dict[str, str], home: Path, proxy: str) -> Path:
    """The served workers' cost model: the home's, else measured now and kept there."""
    cost = home / "cost-model.json"
    if not cost.exists():
        if not (home / "artifacts").exists():
            raise SystemExit("--engine-cost needs an artifact for the model's layer count:"
                             " give --capture N, or --home with one")
        step = [*eldr, "bench", "--engine-cost", "--url", proxy, "--result-dir", str(home)]
        print(" ".join(step[2:]), flush=True)
        subprocess.run(step, env=env, check=True)
    return cost


def _priced_by(cost: Path, policy_config: str | None, policies: str,
               variants: list[str]) -> str:
    """``policy_config`` with ``cost`` set for every eldr policy benched (variants' included)
    that it leaves without one."""
    from dataclasses import fields

    from stages.routing.policies import POLICIES

    config = json.loads(policy_config) if policy_config else {}
    names = set(policies.split(","))
    names |= {v.split("=", 1)[1].split(":", 1)[0] for v in variants if "=" in v}
    priced = [n for n in sorted(names) if n in POLICIES
              and "cost" in {f.name for f in fields(POLICIES[n].Params)}]
    for name in priced:
        config.setdefault(name, {}).setdefault("cost", str(cost))
    return json.dumps(config)


def _calibrate(eldr: list[str], env: dict[str, str], home: Path, model: str, capture: int,
               decode: int) -> None:
    """An artifact for the decode choice at arrival (its centroids and token predictor):
    ``capture`` calibration prompts captured (16 decode tokens each, as the tests' capture),
    then one balanced centroid per decode worker fitted, unless the home has an artifact."""
    if capture > 0:
        step = [*eldr, "capture", "--model", model, "--limit", str(capture), "--max-tokens",
                "16"]
        print(" ".join(step[2:]), flush=True)
        subprocess.run(step, env=env, check=True)
    if (home / "signatures.zarr").exists() and not (home / "artifacts").exists():
        step = [*eldr, "fit", "--k", str(decode), "--balanced", "--no-plot"]
        print(" ".join(step[2:]), flush=True)
        subprocess.run(step, env=env, check=True)


if __name__ == "__main__":
    main()
