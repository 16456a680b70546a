"""The design card's commands against real vLLM, then everything a deployment must do.

The module's one deployment is the card as a user types it: `eldr capture` (the session's
shared calibration capture), `eldr fit --k 20 --balanced`, `eldr serve` with its defaults (1
prefill + 2 decode workers, compiled, NixlConnector, policy eldr; ports moved off the defaults
so a busy machine cannot collide), `eldr bench`. Every test here uses it; the first checks
what the card set up, the fault-injection test runs last because it kills a decode worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from stages.serve.proxy.config import DEFAULT_SILENT_AFTER_S
from stages.signature import wire
from stages.signature.dataset import SignatureDataset
from stages.vllm_compat import NEVER_RUN_ENV, NOT_RUN, installed_vllm, minor
from tests.conftest import home_with, requires_vllm
from tests.fakes.worker import BackgroundServer
from tests.plain_reference import MAX_TOKENS, PROMPTS, complete
from tests.proc_probe import api_server, eldr_ok, running_serve, serve_log
from tests.test_proxy_errors import CASES, LIMIT
from tests.vllm_parity import BATCHES, MORE_CASES, answer, status_of

pytestmark = [requires_vllm, pytest.mark.vllm]

POLICIES = ["eldr-kv", "eldr", "eldr-bl", "rr", "jsq", "random", "p2c"]
FUZZ_EXAMPLES = 80  # per route: about a minute in all on the live workers


@dataclass
class Deployment:
    proc: subprocess.Popen[bytes]
    proxy_url: str
    worker_port: int
    reference: dict[str, str]  # prompt -> greedy output of a single plain vLLM server
    home: Path  # ELDR_HOME: the dataset, the artifact store, the workers' logs
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]

    @property
    def dataset(self) -> Path:
        return self.home / "signatures.zarr"


def _complete(url: str, prompt: str, stream: bool = False, timeout: float = 120) -> str:
    if not stream:  # the very request the plain reference engine was asked
        return complete(url, prompt, timeout)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
        response.raise_for_status()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        event = json.loads(line[len("data: "):])
        assert "error" not in event, event
        text.extend(choice.get("text", "") for choice in event["choices"])
    return "".join(text)


@pytest.fixture(scope="module")
def deployment(calibration: Path, tmp_path_factory: pytest.TempPathFactory,
               plain_reference: dict[str, str]) -> Iterator[Deployment]:
    home = home_with(calibration, tmp_path_factory.mktemp("serve"))
    eldr_ok("fit", "--k", "20", "--balanced", home=home)
    # plain_reference's engine answered and is gone before the workers start: at most three
    # vLLM servers at a time on a small machine.
    reference = dict(plain_reference)
    # The gate is told this release was never run: the deployment runs on the path of a
    # release only the static check passed (a warning, then every worker's self-check).
    with pytest.MonkeyPatch.context() as env:
        env.setenv(NEVER_RUN_ENV, minor(installed_vllm() or ""))
        with running_serve([], home) as served:
            state = httpx.get(f"{served.url}/admin/state", timeout=10).json()
            yield Deployment(
                served.proc, served.url, served.worker_port, reference, home,
                tuple(w["url"] for w in state["prefill_workers"]),
                tuple(w["url"] for w in state["decode_workers"]),
            )


def test_a_release_never_run_serves_after_its_warning_and_the_self_checks(
    deployment: Deployment
) -> None:
    """The gate told this release was never run: `eldr serve` warns, names what was not run,
    self-checks every worker, and serves (every other test here)."""
    log = serve_log(deployment.home).read_text(errors="replace")
    assert f"eldr: warning: vLLM {installed_vllm()}: {NOT_RUN} were not run" in log
    # Once /health said ok (the fixture waited for it), eldr serve says it is ready: the
    # decode workers' batch streams were heard, so no recorded row is lost to a slow joiner.
    deadline = time.monotonic() + 10
    while "ready on http://" not in log and time.monotonic() < deadline:
        time.sleep(0.2)
        log = serve_log(deployment.home).read_text(errors="replace")
    assert f"ready on {deployment.proxy_url}" in log
    state = httpx.get(f"{deployment.proxy_url}/admin/state", timeout=10).json()
    assert state["self_check"] == "on"
    prompt = PROMPTS[0]
    assert complete(deployment.proxy_url, prompt) == deployment.reference[prompt]


def test_the_card_serves_20_clusters_on_two_workers_and_benches(
    deployment: Deployment, tmp_path: Path
) -> None:
    """20 clusters on the default 2 decode workers: the elastic pool spreads them, 10 each;
    `eldr bench` compares a policy with a balancer through the proxy's admin API. The default
    policy is eldr-kv, and every worker publishes its KV events to the proxy."""
    state = httpx.get(f"{deployment.proxy_url}/admin/state", timeout=10).json()
    assert state["policy"] == "eldr-kv"
    assert len(state["kv"]["prefill"]) == 1 and len(state["kv"]["decode"]) == 2
    assert state["kv"]["prefill_compute_groups"] == [0]  # from serve's core plan
    # Where each worker's events are followed: serve's own ipc sockets, one a worker.
    endpoints = [w["endpoint"] for role in ("prefill", "decode") for w in state["kv"][role]]
    assert all(e.startswith("ipc://") for e in endpoints) and len(set(endpoints)) == 3
    assert [len(w["clusters"]) for w in state["decode_workers"]] == [10, 10]
    eldr_ok("bench", "--url", deployment.proxy_url, "--policies", "eldr,jsq", "--num-prompts",
            "8", "--rounds", "1", "--max-tokens", "8", "--request-rate", "inf",
            "--result-dir", str(tmp_path), home=deployment.home)
    results = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    runs = [r for r in results if r.get("completed") is not None]
    assert runs and all(r["completed"] == 8 and r["failed"] == 0 for r in runs), results


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("stream", [False, True])
def test_outputs_through_proxy_equal_single_server(
    deployment: Deployment, policy: str, stream: bool
) -> None:
    httpx.post(f"{deployment.proxy_url}/admin/policy", json={"policy": policy},
               timeout=10).raise_for_status()
    for prompt in PROMPTS:
        assert _complete(deployment.proxy_url, prompt, stream=stream) == deployment.reference[
            prompt
        ]


def _counters(urls: tuple[str, ...], prefix: str, label: str = "") -> float:
    """The sum of a Prometheus counter over ``urls``' /metrics (lines with ``label``)."""
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith(prefix) and label in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def _proxy_cached(deployment: Deployment, leg: str) -> float:
    return _counters((deployment.proxy_url,), "eldr_kv_cached_tokens_total", f'leg="{leg}"')


def _reused(deployment: Deployment) -> tuple[float, float, float, float]:
    """Prompt tokens the proxy expected the chosen prefill / decode workers to hold, and those
    the prefill / decode workers say they took from their prefix caches."""
    return (_proxy_cached(deployment, "prefill"), _proxy_cached(deployment, "decode"),
            _counters(deployment.prefill_urls, "vllm:prefix_cache_hits_total"),
            _counters(deployment.decode_urls, "vllm:prompt_tokens_by_source_total",
                      'source="local_cache_hit"'))


def _events_settled(deployment: Deployment) -> None:
    """Wait until the proxy has applied every KV event batch the workers sent so far."""
    def batches() -> float:
        return _counters((deployment.proxy_url,), "eldr_kv_event_batches_total")

    last, deadline = -1.0, time.monotonic() + 20
    while time.monotonic() < deadline:
        now = batches()
        if now == last:
            return
        last = now
        time.sleep(0.5)


@pytest.mark.parametrize("chat", [False, True])
def test_the_proxy_predicts_every_prefix_cache_hit_the_workers_make(
    deployment: Deployment, chat: bool
) -> None:
    """The block hashes the proxy computes for a request (its tokenizer, the chat template, the
    workers' hash) are the ones the workers' KV events carry: over a conversation whose turns
    extend each other (prompts ending mid-block), the prompt tokens the proxy expected each
    chosen worker to hold are exactly the ones vLLM's own counters say it reused, on the
    prefill workers and on the decode workers (compiled mode, eldr-kv)."""
    httpx.post(f"{deployment.proxy_url}/admin/policy", json={"policy": "eldr-kv"},
               timeout=10).raise_for_status()
    before = _reused(deployment)
    # Long enough from the first turn to fill whole blocks (128 tokens on CPU workers).
    history = uuid.uuid4().hex + " The committee reviewed the annual report on water quality." * 25
    messages = [{"role": "system", "content": "You answer briefly."}]
    for turn in range(3):
        line = f" Turn {turn}: list the districts whose wells were tested in spring."
        history += line
        if chat:
            messages.append({"role": "user", "content": history if turn == 0 else line})
            body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
            route = "chat/completions"
        else:
            body = {"model": "tiny", "prompt": history, "max_tokens": 8, "temperature": 0}
            route = "completions"
        response = httpx.post(f"{deployment.proxy_url}/v1/{route}", json=body, timeout=120)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        if chat:
            messages.append({"role": "assistant", "content": choice["message"]["content"]})
        _events_settled(deployment)
    after = _reused(deployment)
    predicted_prefill, predicted_decode, prefill_hits, decode_hits = (
        b - a for a, b in zip(before, after, strict=True))
    assert prefill_hits > 0 and decode_hits > 0
    assert (predicted_prefill, predicted_decode) == (prefill_hits, decode_hits)
    # Every worker published what it stored, the first turn (new: matched from its head
    # alone) included, so none still owes events once the bound has passed.
    time.sleep(DEFAULT_SILENT_AFTER_S + 0.5)
    kv = httpx.get(f"{deployment.proxy_url}/admin/state", timeout=10).json()["kv"]
    trusted = [w["trusted"] for role in ("prefill", "decode") for w in kv[role]]
    assert trusted and all(trusted), kv


def _set_eldr_kv(deployment: Deployment, **config: object) -> None:
    httpx.post(f"{deployment.proxy_url}/admin/policy",
               json={"policy": "eldr-kv", "config": config}, timeout=10).raise_for_status()


def test_a_request_its_decode_worker_prefills_itself_answers_as_the_pd_path(
    deployment: Deployment
) -> None:
    """Conditional disaggregation (eldr-kv's local_prefill_below): a request that skips the
    prefill worker, its decode worker prefilling it itself, gives the same greedy output as
    the same request on the PD path (prefill worker, KV hand-off), and the proxy counts it as
    local. The second request is a conversation's next turn: its decode worker holds nearly
    all of the prompt."""
    prompt = uuid.uuid4().hex + " The council published the survey of river crossings." * 20
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}

    def answer_now() -> str:
        response = httpx.post(f"{deployment.proxy_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    def local_prefills() -> float:
        return _counters((deployment.proxy_url,), "eldr_router_local_prefills_total")

    try:
        _set_eldr_kv(deployment, local_prefill_below=0, decode_choice="after-prefill")
        before = local_prefills()
        on_pd_path = answer_now()
        assert local_prefills() == before
        _events_settled(deployment)  # the proxy knows which decode worker holds the prompt
        _set_eldr_kv(deployment, local_prefill_below=1_000_000)
        prefilled_locally = answer_now()
        assert local_prefills() == before + 1
    finally:  # the options stay for later switches back to eldr-kv: the default again
        _set_eldr_kv(deployment, local_prefill_below=0)
    assert on_pd_path and prefilled_locally == on_pd_path


def test_a_decode_worker_chosen_at_arrival_answers_as_one_chosen_after_prefill(
    deployment: Deployment
) -> None:
    """eldr-kv's ``decode_choice: "arrival"`` on real workers: the decode worker is chosen
    before the prefill (once per request), the KV hand-off goes to it, a conversation's next
    turn goes to the worker holding its history, and the greedy answers are the ones the
    paper's after-prefill choice gives for the same prompts."""
    first = uuid.uuid4().hex + " The board listed the wells it tested in each district." * 20

    def turns() -> list[str]:
        answers, prompt = [], first
        for turn in range(2):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            before = _proxy_cached(deployment, "decode")
            decisions = _counters((deployment.proxy_url,), "eldr_router_decisions_total")
            response = httpx.post(f"{deployment.proxy_url}/v1/completions", json=body,
                                  timeout=120)
            response.raise_for_status()
            answers.append(response.json()["choices"][0]["text"])
            assert _counters((deployment.proxy_url,),
                             "eldr_router_decisions_total") == decisions + 1
            if turn:  # the decode worker that holds the history was chosen
                assert _proxy_cached(deployment, "decode") > before
            _events_settled(deployment)
            prompt += answers[-1] + " Which of them failed the nitrate limit?"
        return answers

    try:
        _set_eldr_kv(deployment, decode_choice="arrival", local_prefill_below=0)
        at_arrival = turns()
        _set_eldr_kv(deployment, decode_choice="after-prefill")
        assert turns() == at_arrival and all(at_arrival)
    finally:
        _set_eldr_kv(deployment, decode_choice="after-prefill")


def _signature_answer(url: str, prompt: str, kv: dict | None = None) -> dict:
    """``url``'s ``kv_transfer_params`` for ``prompt`` (greedy, one token)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if kv is not None:
        body["kv_transfer_params"] = kv
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json().get("kv_transfer_params") or {}


def test_a_decode_workers_signature_over_a_prefix_it_pulled_is_unknown_not_wrong(
    deployment: Deployment
) -> None:
    """A decode worker never ran the prompt blocks it pulled over NIXL, so it does not know
    their expert counts: a request it then prefills itself on that prefix (eldr-kv's local
    prefill) gets no signature from it and is counted unknown, rather than a signature summed
    from zeros or a previous occupant's counts; the pull itself counts no empty signature."""
    from stages.serve.proxy.front.request import PREFILL_KV_TRANSFER_PARAMS

    prefill, decode = deployment.prefill_urls[0], deployment.decode_urls[0]
    head = uuid.uuid4().hex + " The harbour board listed every ferry by its tonnage." * 30
    turn = head + " Which of them sails first on Sundays?"

    def counter(name: str, label: str = "") -> float:
        return _counters((decode,), name, label)

    zero, unknown = counter("eldr_zero_signatures_total"), counter("eldr_unknown_signatures_total")
    # The PD path by hand: the prefill worker runs the head, the decode worker pulls its KV.
    handoff = _signature_answer(prefill, head, dict(PREFILL_KV_TRANSFER_PARAMS))
    assert wire.decode(handoff) is not None
    pulled = counter("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
    _signature_answer(decode, head, handoff)  # as the proxy passes it
    assert counter("vllm:prompt_tokens_by_source_total",
                   'source="external_kv_transfer"') > pulled
    # The next turn, prefilled by the decode worker itself on the pulled head.
    hits = counter("vllm:prompt_tokens_by_source_total", 'source="local_cache_hit"')
    local = _signature_answer(decode, turn)
    assert counter("vllm:prompt_tokens_by_source_total", 'source="local_cache_hit"') > hits
    reference = wire.decode(_signature_answer(prefill, turn))  # it computed the head itself
    assert reference is not None
    got = wire.decode(local)
    if got is not None:  # known only where it is right
        np.testing.assert_array_equal(got, reference)
    else:  # the worker's connector stats reach its /metrics with a later engine step
        deadline = time.monotonic() + 20
        while counter("eldr_unknown_signatures_total") == unknown and time.monotonic() < deadline:
            time.sleep(0.5)
        assert counter("eldr_unknown_signatures_total") == unknown + 1
    assert counter("eldr_zero_signatures_total") == zero


def test_workers_keep_vllms_hybrid_kv_cache_manager(deployment: Deployment) -> None:
    # vLLM turns its hybrid KV cache manager off for the whole engine when any connector lacks
    # SupportsHMA (sliding-window models then run slower): eldr's connector must not be one.
    logs = sorted((deployment.home / "logs").glob("vllm-*.log"))
    assert len(logs) == 3
    for log in logs:
        assert "Turning off hybrid kv cache manager" not in log.read_text(errors="replace"), log


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", BATCHES)
def test_batches_through_proxy_equal_single_server(
    deployment: Deployment, name: str, stream: bool
) -> None:
    """Prompt lists, token-id lists, n > 1 (greedy and seeded), echo, chat: each sequence its
    own prefill and decode, merged into what a decode worker answers when asked directly (the
    issue's repro: there, the second prompt's text continued the first's)."""
    path, body = BATCHES[name]
    direct = deployment.decode_urls[0]
    assert answer(deployment.proxy_url, path, body, stream) == answer(direct, path, body, stream)


def test_malformed_requests_get_vllms_status(deployment: Deployment) -> None:
    """The malformed-request table against a proxy on the live workers and against vLLM
    itself (a decode worker), status for status; the proxy's own routes (/admin) have no
    vLLM counterpart, and an oversized body is the proxy's 413 by design."""
    from stages.serve.proxy import create_app
    from stages.serve.proxy.config import ProxyConfig

    config = ProxyConfig(
        prefill_urls=deployment.prefill_urls, decode_urls=deployment.decode_urls,
        policy="rr", model="tiny", max_body_bytes=LIMIT,
    )
    vllm = deployment.decode_urls[0]
    cases = [c for c in (*CASES, *MORE_CASES) if not c.path.startswith("/admin")]
    assert len(cases) >= 40
    differ = []
    with BackgroundServer(create_app(config)) as proxy:
        for case in cases:
            got = status_of(proxy.url, case)
            if case.status == 413:
                assert got == 413, case.id
                continue
            want = status_of(vllm, case)
            if got != want or (case in MORE_CASES and want != case.status):
                differ.append(f"{case.id}: proxy {got}, vLLM {want}, listed {case.status}")
    assert not differ, "\n".join(differ)


def test_schema_fuzzed_requests_get_vllms_status_class(deployment: Deployment) -> None:
    """Requests generated from the OpenAPI document the live decode worker publishes (valid
    and not, tests/openapi_fuzz.py), to a proxy on the live workers and to vLLM itself: the
    same status class for every one, never a 5xx of the proxy's own, every 4xx from the proxy in
    vLLM's error shape, every answer read to its end within a minute, and nothing left in
    flight."""
    from hypothesis import HealthCheck, Phase, given, settings

    from stages.serve.proxy import create_app
    from stages.serve.proxy.config import ProxyConfig
    from tests.openapi_fuzz import ROUTES, error_shape_problem, request_bodies, send

    vllm = deployment.decode_urls[0]
    openapi = httpx.get(f"{vllm}/openapi.json", timeout=30).json()
    config = ProxyConfig(prefill_urls=deployment.prefill_urls,
                         decode_urls=deployment.decode_urls, policy="eldr-union", model="tiny")
    seen: dict[tuple[int, int], int] = {}

    def fuzz(proxy: str, route: str) -> Callable[[], None]:
        # derandomized: CI sends the same examples every run, so a failure reproduces.
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate, Phase.shrink],
                  suppress_health_check=list(HealthCheck))
        @given(request_bodies(openapi, route, "tiny"))
        def same_class(body: object) -> None:
            got, want = send(proxy, route, body, 60), send(vllm, route, body, 60)
            seen[got.status, want.status] = seen.get((got.status, want.status), 0) + 1
            # The proxy's own 5xx never; vLLM's own 500 on a body it mishandles (a message part
            # that is a bare string made it raise), relayed as it came, only where vLLM gives it.
            assert got.status < 500 or want.status == got.status == 500, (got, want)
            assert got.status // 100 == want.status // 100, (got, want)
            assert got.status // 100 != 4 or error_shape_problem(got) is None, \
                (error_shape_problem(got), want)
            assert got.ended and want.ended, (got, want)

        return same_class

    with BackgroundServer(create_app(config)) as proxy:
        for route in ROUTES:
            fuzz(proxy.url, route)()
        state = httpx.get(f"{proxy.url}/admin/state", timeout=10).json()
    assert all(w["in_flight"] == 0 for w in state["prefill_workers"] + state["decode_workers"])
    # Both paths were reached: requests vLLM served and requests it refused (a fresh-clone
    # CI's draw had vLLM serve 8 of 160 bodies).
    assert sum(n for (_, want), n in seen.items() if want == 200) >= 5, seen
    assert sum(n for (_, want), n in seen.items() if want >= 400) >= 10, seen


def _prompt_tokens_by_source(deployment: Deployment) -> tuple[float, float]:
    """(pulled over NIXL, computed locally) prompt tokens, summed over the decode workers."""
    external = computed = 0.0
    for url in deployment.decode_urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total"):
                value = float(line.rsplit(" ", 1)[1])
                if 'source="external_kv_transfer"' in line:
                    external += value
                elif 'source="local_compute"' in line:
                    computed += value
    return external, computed


def test_decode_workers_load_kv_from_prefill(deployment: Deployment) -> None:
    # Counted over these requests only (earlier tests also ask the decode workers directly),
    # on prompts no worker has cached yet (a decode worker's own prefix-cache hit pulls none).
    external0, computed0 = _prompt_tokens_by_source(deployment)
    for prompt in PROMPTS:
        _complete(deployment.proxy_url, f"{uuid.uuid4().hex} {prompt}")
    external1, computed1 = _prompt_tokens_by_source(deployment)
    external, computed = external1 - external0, computed1 - computed0
    assert external > 0
    # vLLM recomputes at most the last prompt token of each request on the decode side.
    assert computed <= external * 0.2


def test_prefill_signature_equals_captured_signature(deployment: Deployment) -> None:
    arrays = SignatureDataset.open(deployment.dataset).read()
    from stages.paths import CALIBRATION_PROMPTS
    from stages.prompts import load_prompts

    prompt = load_prompts(CALIBRATION_PROMPTS)[0]
    row = int(np.flatnonzero(arrays.ids == prompt.id)[0])
    prefill = deployment.prefill_urls[0]
    body = {"model": "tiny", "prompt": prompt.prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}}
    response = httpx.post(f"{prefill}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    signature = wire.decode(response.json()["kv_transfer_params"])
    assert signature is not None
    np.testing.assert_array_equal(signature, arrays.prefill_counts[row])


def test_proxy_reports_decode_expert_metrics(deployment: Deployment) -> None:
    state = httpx.get(f"{deployment.proxy_url}/admin/state", timeout=10).json()
    assert state["policy"] in POLICIES
    steps = 0.0
    for url in deployment.decode_urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("eldr_decode_steps_total"):
                steps += float(line.rsplit(" ", 1)[1])
    assert steps > 0


def test_bench_compares_policies_on_the_live_proxy(
    deployment: Deployment, tmp_path: Path
) -> None:
    out = eldr_ok("bench", "--url", deployment.proxy_url, "--policies", "eldr,eldr-bl,rr",
                  "--num-prompts", "4", "--request-rate", "4", "--max-tokens", "8", "--rounds",
                  "1", "--result-dir", str(tmp_path), home=deployment.home)
    assert "best baseline: TPOT p50 rr" in out
    for policy in ("eldr", "eldr-bl", "rr"):
        result = json.loads((tmp_path / f"{policy}-4qps.json").read_text())
        assert result["completed"] == 4 and result["failed"] == 0
        assert result["median_tpot_ms"] > 0
        # Distinct experts per decode step come from the decode workers' own counters:
        # between one request's top-k (2) and all 16 experts.
        assert 2 <= result["distinct_experts_per_layer"] <= 16
    assert (tmp_path / "tpot-4qps.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_conversations_on_the_live_workers(deployment: Deployment, tmp_path: Path) -> None:
    """`eldr bench --workload conversations`: a policy through the admin API and the same proxy
    driven as a plain router, each on its own fresh conversations; a later turn's prompt holds
    its history, so the prefill worker's own counters see hits, and the decode workers pull
    KV over NIXL."""
    out = eldr_ok("bench", "--url", deployment.proxy_url, "--policies", "rr", "--router",
                  f"as-is={deployment.proxy_url}", "--workload", "conversations",
                  "--conversations", "2", "--turns", "2", "--max-tokens", "8",
                  "--system-tokens", "256", "--message-tokens", "64", "--think-time", "0",
                  "--rounds", "1", "--result-dir", str(tmp_path), home=deployment.home)
    assert "TTFT p50 t>=2" in out
    for name in ("rr", "as-is"):
        doc = json.loads((tmp_path / f"{name}-conversations.json").read_text())
        assert doc["completed"] == 4 and doc["failed"] == 0, doc["errors"]
        assert doc["median_ttft_later_ms"] > 0 and doc["median_tpot_ms"] > 0
        assert 0 < doc["prefill_hit_share"] <= 1 and doc["ideal_prefill_hit_share"] > 0
        assert doc["decode_kv_pulled_tokens"] > 0
        # Where TTFT goes, from the workers' own histograms: each engine's part is a part.
        assert 0 < doc["prefill_engine_ms"] < doc["mean_ttft_ms"]
        assert 0 < doc["decode_engine_queue_ms"] <= doc["decode_engine_ttft_ms"]
        assert doc["decode_engine_ttft_ms"] < doc["mean_ttft_ms"]
    assert "where TTFT goes" in out


def test_results_files_carry_every_key_of_vllms_own_benchmark(
    deployment: Deployment, tmp_path: Path, tiny_model: Path
) -> None:
    """`vllm bench serve --save-result --save-detailed` against the proxy, and `eldr bench`:
    every key of vLLM's file is in eldr's, and eldr's lists have one entry per request."""
    vllm_dir, eldr_dir = tmp_path / "vllm", tmp_path / "eldr"
    cmd = [sys.executable, "-m", "tests.vllm_cli", "bench", "serve", "--backend", "openai",
           "--base-url", deployment.proxy_url, "--endpoint", "/v1/completions",
           "--model", "tiny", "--tokenizer", str(tiny_model), "--dataset-name", "random",
           "--random-input-len", "24", "--random-output-len", "6", "--num-prompts", "3",
           "--request-rate", "inf", "--save-result", "--save-detailed",
           "--result-dir", str(vllm_dir), "--result-filename", "vllm.json", "--seed", "0"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    theirs = json.loads((vllm_dir / "vllm.json").read_text())
    assert theirs["completed"] == 3
    eldr_ok("bench", "--url", deployment.proxy_url, "--policies", "rr", "--num-prompts", "3",
            "--max-tokens", "6", "--rounds", "1", "--result-dir", str(eldr_dir),
            home=deployment.home)
    [path] = eldr_dir.glob("rr-*.json")
    ours = json.loads(path.read_text())
    assert not set(theirs) - set(ours), f"missing in eldr's file: {set(theirs) - set(ours)}"
    assert ours["model_id"] == "tiny" and ours["tokenizer_id"] == "tiny"
    for key, value in theirs.items():
        if isinstance(value, list) and len(value) == theirs["num_prompts"]:
            assert len(ours[key]) == ours["num_prompts"], key


def test_engine_cost_measures_the_live_decode_workers(deployment: Deployment) -> None:
    from stages.bench.cost.engine_cost import EngineCostConfig, measure_engine_cost
    from stages.bench.cost.engine_cost_passes import ProbePass, drift, excluded_prompts, fit_passes
    from stages.paths import EVALUATION_PROMPTS

    workers = deployment.decode_urls[:1]
    result = measure_engine_cost(EngineCostConfig(
        worker_urls=workers, prompts_path=EVALUATION_PROMPTS, num_layers=4, batch_sizes=(1, 4),
        domain_mixes=(1, 0), repeats=1, max_tokens=8, prefill_probes=0, model="tiny",
    ))
    assert [(m.batch_size, m.domains) for m in result.measurements][:3] == [
        (1, 1), (1, 1), (4, 1)
    ]
    assert all(m.step_time_source == "counter" for m in result.measurements)
    assert all(m.sample.steps > 0 and m.sample.step_s > 0 for m in result.measurements)
    # One request uses exactly top-k experts per layer per step; four of mixed domains more.
    singles = [m.sample for m in result.measurements if m.batch_size == 1]
    assert [s.distinct for s in singles] == pytest.approx([2.0, 2.0])
    mixed = result.measurements[-1]
    assert mixed.batch_size == 4 and mixed.domains > 1
    assert mixed.sample.distinct > 2.0 and mixed.sample.batch > 1
    assert result.model.num_layers == 4

    # A second pass, as `--another-pass` runs it: other prompts, its drift, one fit over both.
    first = ProbePass.of(result, "first", workers, (1,))
    again = measure_engine_cost(EngineCostConfig(
        worker_urls=workers, prompts_path=EVALUATION_PROMPTS, num_layers=4, batch_sizes=(1, 4),
        domain_mixes=(1, 0), repeats=1, max_tokens=8, prefill_probes=0, model="tiny", seed=1,
        warmup=False, exclude_prompts=excluded_prompts([first]),
    ))
    second = ProbePass.of(again, "second", workers, (1,))
    assert not set(first.prompt_ids) & set(second.prompt_ids)
    moved = drift(first, second)
    assert 0.5 < moved.step < 2.0  # the same engine a few seconds later
    both = fit_passes([first, second])
    assert len(both.measurements) == len(result.measurements) + len(again.measurements)


def test_engine_cost_times_the_kv_hand_off(deployment: Deployment) -> None:
    """With the prefill workers given, each probe prompt's KV is handed off to the measured
    decode worker and one token decoded from it: the slope over prompt lengths is the KV pull
    per token the routing objective prices (eldr-kv)."""
    from stages.bench.cost.engine_cost import EngineCostConfig, measure_engine_cost
    from stages.paths import EVALUATION_PROMPTS
    from stages.routing.cost_model import fit_prefill

    result = measure_engine_cost(EngineCostConfig(
        worker_urls=deployment.decode_urls[:1], prompts_path=EVALUATION_PROMPTS, num_layers=4,
        batch_sizes=(1, 2), domain_mixes=(1, 0), repeats=1, max_tokens=4, prefill_probes=3,
        prefill_urls=deployment.prefill_urls, model="tiny", warmup=False, seed=2,
    ))
    assert len(result.transfer_points) == 3
    assert len({t for t, _ in result.transfer_points}) == 3
    assert all(s > 0 for _, s in result.transfer_points)
    tokens, seconds = zip(*result.transfer_points, strict=True)
    assert result.model.kv_transfer_per_token_s == fit_prefill(tokens, seconds)[1]


def _vllm_load(decode_url: str) -> int:
    """Requests a vLLM worker holds now (running and waiting), from its own metrics."""
    text = httpx.get(f"{decode_url}/metrics", timeout=10).text
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith(("vllm:num_requests_running{",
                                         "vllm:num_requests_waiting{"))))


def _routing_view(control_url: str) -> tuple[list[int], int]:
    """Per decode worker, the requests a proxy routes around; and how many of the others'
    it counts without weighing their experts (their signatures did not reach it)."""
    workers = httpx.get(f"{control_url}/admin/state", timeout=10).json()["decode_workers"]
    return ([w["in_flight"] + w["others_in_flight"] for w in workers],
            sum(w["others_in_flight"] - w["others_weighed"] for w in workers))


def _proxy_addresses(url: str) -> list[str]:
    """One address per process of the proxy group at ``url`` (each one's peers name the
    others; the kernel hands new connections to either)."""
    peers: dict[str, list[str]] = {}
    deadline = time.monotonic() + 30
    while len(peers) < 2 and time.monotonic() < deadline:
        state = httpx.get(f"{url}/admin/state", timeout=10).json()
        peers[state["proxy"]] = state["peers"]
    assert len(peers) == 2, peers
    return sorted({u for named in peers.values() for u in named})


def test_proxies_attached_beside_the_deployment_share_its_view_of_every_decode_worker(
    deployment: Deployment,
) -> None:
    """A second `eldr serve --attach-* --attach-batch --proxy-workers 2` in front of the same
    workers: with streams from both running, each of the three proxies sees on each decode
    worker what vLLM holds, within one request (its own requests, and the others' as the
    workers publish them), weighs the experts of every one of the others' requests (their
    signatures came with the workers' batches), and answers as a single proxy does."""
    state = httpx.get(f"{deployment.proxy_url}/admin/state", timeout=10).json()
    endpoints = [w["batch_endpoint"] for w in state["decode_workers"]]
    assert all(e and e.startswith("tcp://127.0.0.1:") for e in endpoints), endpoints
    args = ["--model", "tiny", "--policy", "jsq", "--proxy-workers", "2"]
    for url in deployment.prefill_urls:
        args += ["--attach-prefill", url]
    for url, endpoint in zip(deployment.decode_urls, endpoints, strict=True):
        args += ["--attach-decode", url, "--attach-batch", endpoint]
    httpx.post(f"{deployment.proxy_url}/admin/policy", json={"policy": "jsq"},
               timeout=10).raise_for_status()
    with running_serve(args, deployment.home, timeout_s=180) as group:
        proxies = [deployment.proxy_url, *_proxy_addresses(group.url)]
        # Long enough that most samples fall between the streams' starts and ends, where
        # vLLM's own gauges (updated once a step) lag what it holds.
        body = {"model": "tiny", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
        samples: list[tuple[list[int], list[list[int]]]] = []
        unweighed: list[list[int]] = []
        with ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(httpx.post, f"{url}/v1/completions",
                                   json={**body, "prompt": PROMPTS[i % 3]}, timeout=300)
                       for i, url in enumerate([deployment.proxy_url, group.url] * 3)]
            while not all(f.done() for f in streams):
                truth = [_vllm_load(url) for url in deployment.decode_urls]
                views, missing = zip(*(_routing_view(url) for url in proxies), strict=True)
                if sum(truth) >= 2:
                    samples.append((truth, list(views)))
                    unweighed.append(list(missing))
                time.sleep(0.2)
            assert all(f.result().status_code == 200 for f in streams)
        close = [max(abs(v - t) for view in views for v, t in zip(view, truth, strict=True)) <= 1
                 for truth, views in samples]
        # Where vLLM's load held still around a sample, every proxy saw it within one request;
        # elsewhere streams start or end, and vLLM's gauges (set once a step) and the
        # proxies (read one after another) each catch the change at their own moment.
        steady = [i for i in range(1, len(samples) - 1)
                  if samples[i - 1][0] == samples[i][0] == samples[i + 1][0]]
        assert len(steady) >= 5 and all(close[i] for i in steady), samples
        assert sum(close) >= 0.7 * len(samples), samples
        assert all(sum(unweighed[i]) == 0 for i in steady), unweighed
        assert [_complete(group.url, p) for p in PROMPTS] == [
            deployment.reference[p] for p in PROMPTS]
        # The attached proxy forwards under the name the workers list in /v1/models (it read
        # it there, for its self-check too): a request that names no model is served.
        models = httpx.get(f"{deployment.decode_urls[0]}/v1/models", timeout=10).json()
        unnamed = httpx.post(f"{group.url}/v1/completions", timeout=120,
                             json={"prompt": PROMPTS[0], "max_tokens": 1})
        assert unnamed.status_code == 200, unnamed.text
        assert unnamed.json()["model"] == models["data"][0]["id"]
        print(f"\n{sum(close)} of {len(samples)} samples ({len(steady)} steady, all of them):"
              f" every proxy within one request of vLLM on every decode worker: {samples};"
              f" others' requests not weighed, per sample and proxy: {unweighed}")


def test_a_recording_proxy_keeps_each_requests_decode_as_the_decode_workers_measured_it(
    deployment: Deployment, tmp_path: Path,
) -> None:
    """`eldr serve --attach-* --attach-batch --record` beside the deployment, policy eldr-union
    (no artifact): each request it routes becomes a row of a dataset `eldr fit` reads, with
    the prefill signature and the decode counts the decode worker measured. Asked as `eldr
    capture` asked (greedy, 16 tokens, ignore_eos), the rows equal the capture's."""
    from stages.paths import CALIBRATION_PROMPTS
    from stages.prompts import load_prompts
    from tests.conftest import CALIBRATION_TOKENS

    state = httpx.get(f"{deployment.proxy_url}/admin/state", timeout=10).json()
    traffic = tmp_path / "traffic.zarr"
    args = ["--model", "tiny", "--policy", "eldr-union", "--record", "--record-to", str(traffic)]
    for url in deployment.prefill_urls:
        args += ["--attach-prefill", url]
    for w in state["decode_workers"]:
        args += ["--attach-decode", w["url"], "--attach-batch", w["batch_endpoint"]]
    prompts = load_prompts(CALIBRATION_PROMPTS)[:10]
    with running_serve(args, deployment.home, timeout_s=180) as recording:
        for i, prompt in enumerate(prompts):
            body = {"model": "tiny", "prompt": prompt.prompt, "temperature": 0,
                    "max_tokens": CALIBRATION_TOKENS, "ignore_eos": True, "stream": i % 2 == 0}
            # One X-Request-Id for all: the client's id is echoed, never eldr's key.
            answer = httpx.post(f"{recording.url}/v1/completions", json=body,
                                headers={"X-Request-Id": "one-id"}, timeout=120)
            answer.raise_for_status()
            assert answer.headers["x-request-id"] == "one-id"
            if not body["stream"]:
                assert answer.json()["id"] == "cmpl-one-id"  # as vLLM names it
    recorded = SignatureDataset.open(traffic)
    captured = SignatureDataset.open(deployment.dataset)
    assert recorded.identity == captured.identity  # the served model's, as capture writes it
    rows, cap = recorded.read(), captured.read()
    assert len(rows) == len(prompts)
    row_of = {sha: i for i, sha in enumerate(cap.prompt_sha256)}
    for r in range(len(rows)):
        c = row_of[rows.prompt_sha256[r]]
        assert rows.output_tokens[r] == CALIBRATION_TOKENS
        assert rows.prompt_tokens[r] == cap.prompt_tokens[c]
        np.testing.assert_array_equal(rows.prefill_counts[r], cap.prefill_counts[c])
        # Every token the decode worker ran forward (all but the last sampled), top-k picks in
        # every MoE layer: the worker counted each exactly once.
        per_layer = rows.decode_counts[r].sum(axis=1)
        assert (per_layer == recorded.identity.top_k * (CALIBRATION_TOKENS - 1)).all()
        np.testing.assert_array_equal(rows.decode_counts[r], cap.decode_counts[c])
    assert np.isfinite(recorded.traffic()["latency_s"]).all()
    eldr_ok("fit", "--data", str(traffic), "--k", "2", "--store", str(tmp_path / "store"),
            home=deployment.home)


def test_killing_a_decode_worker_loses_no_unstarted_request(deployment: Deployment) -> None:
    """Non-streamed requests have sent nothing yet, so all must succeed via retries."""
    httpx.post(f"{deployment.proxy_url}/admin/policy", json={"policy": "rr"},
               timeout=10).raise_for_status()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    # The last decode worker's API server (workers take consecutive ports, prefill first).
    victim = api_server(deployment.proc.pid, deployment.worker_port + 2)

    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = [pool.submit(_complete, deployment.proxy_url, p, timeout=180) for p in prompts]
        time.sleep(1.5)
        os.kill(victim, signal.SIGKILL)
        results = [a.result() for a in answers]
    assert results == [deployment.reference[p] for p in prompts]
    state = httpx.get(f"{deployment.proxy_url}/admin/state", timeout=10).json()
    assert all(w["in_flight"] == 0 for w in state["decode_workers"])
