"""`eldr serve --record`: decode workers measure a recorded request's decode and publish it
when it ends; the proxy joins it with the prefill signature it routed on and appends the row
to a signature dataset `eldr fit` reads. Here: the scheduler-side ledger, the wire, the writer
thread, and proxies in front of fake workers that publish as eldr's connector does. The test
against real vLLM is in tests/test_serve_real.py."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from stages.capture.batch_publisher import RECORD_KEY, BatchMessage, FinishedRequest
from stages.capture.ledger import SignatureLedger
from stages.capture.messages import StepReport
from stages.errors import EldrError
from stages.serve.deploy import ServeOptions
from stages.serve.proxy import create_app
from stages.serve.proxy.recording.recorder import RecordConfig
from stages.serve.proxy.recording.row import RecordedRow, build_record, identity_of
from stages.signature import wire
from stages.signature.appender import WRITER_NICE, DatasetAppender
from stages.signature.dataset import ModelIdentity, SignatureDataset, store_exists
from tests.conftest import free_port
from tests.fakes.publishing_workers import publishing_workers
from tests.fakes.worker import (
    BackgroundServer,
    FakeBehavior,
    create_fake_worker,
    domain_signature,
)
from tests.proc_probe import command, tree, wait_gone
from tests.test_proxy import fast_config


def _remote_step(req_id: str, prompt_len: int, blocks: list[int]) -> SimpleNamespace:
    """A decode worker's first step of a request whose prompt KV came from a prefill worker:
    the prompt is computed already, one decode token is scheduled."""
    new = SimpleNamespace(req_id=req_id, prompt_token_ids=list(range(prompt_len)),
                          block_ids=(blocks,), num_computed_tokens=prompt_len)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                             num_computed_tokens=[])
    return SimpleNamespace(num_scheduled_tokens={req_id: 1}, finished_req_ids=set(),
                           scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           total_num_scheduled_tokens=1)


def _next_step(req_id: str, computed: int) -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[req_id], new_block_ids=[None], resumed_req_ids=set(),
                             num_computed_tokens=[computed])
    return SimpleNamespace(num_scheduled_tokens={req_id: 1}, finished_req_ids=set(),
                           scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           total_num_scheduled_tokens=1)


def test_a_remote_request_asked_to_record_has_its_decode_counted_and_handed_over() -> None:
    ledger = SignatureLedger(block_size=16, shape=None, count_decode=False)
    ledger.mark_remote("r")
    ledger.mark_record("r", "proxy-tag")
    ledger.mark_remote("quiet")  # not asked: nothing counted, nothing handed over
    plan = ledger.plan(_remote_step("r", 20, [3, 4]))
    assert plan.decode_slots == {"r": [4 * 16 + 4]}  # position 20: block 4, offset 4
    assert plan.snapshots == {}  # its prompt ran elsewhere: no signature here
    assert ledger.plan(_remote_step("quiet", 20, [5, 6])).decode_slots == {}
    step = np.zeros((2, 4), dtype=np.int32)
    step[:, 1] = 1
    ledger.apply(StepReport(decode_counts={"r": step}))
    assert ledger.plan(_next_step("r", 21)).decode_slots == {"r": [4 * 16 + 5]}
    assert ledger.finished("r", output_tokens=3) == {}  # the response carries nothing new
    assert ledger.recorded == []  # the last step's counts are not in yet
    ledger.apply(StepReport(decode_counts={"r": step}))
    [(name, prompt_tokens, output_tokens, counts)] = ledger.recorded
    assert (name, prompt_tokens, output_tokens) == ("proxy-tag", 20, 3)
    np.testing.assert_array_equal(counts, 2 * step)


def test_a_recorded_request_aborted_before_it_ran_is_forgotten() -> None:
    ledger = SignatureLedger(block_size=16, shape=(2, 4), count_decode=False)
    ledger.mark_record("gone", "tag")
    ledger.finished("gone")
    ledger.apply(None)
    assert ledger.recorded == []
    plan = ledger.plan(_remote_step("gone", 20, [1, 2]))  # the id reused: not asked this time
    assert plan.decode_slots == {}


def test_finished_requests_travel_with_the_batch_and_bad_ones_are_refused() -> None:
    counts = np.arange(8, dtype=np.int32).reshape(2, 4)
    message = BatchMessage(3, frozenset({"a"}), (FinishedRequest.measured("b", 20, 5, counts),))
    back = BatchMessage.decode(message.encode())
    assert back.requests == {"a"} and back.finished[0].name == "b"
    assert (back.finished[0].prompt_tokens, back.finished[0].output_tokens) == (20, 5)
    np.testing.assert_array_equal(wire.decode(back.finished[0].decode_counts), counts)
    assert "finished" not in json.loads(BatchMessage(4, frozenset()).encode())
    raw = json.loads(message.encode())
    for bad in ([{"name": "b", "prompt_tokens": 1, "output_tokens": -1}], [3], "x",
                [{**raw["finished"][0], "decode_counts": {"eldr_signature_shape": [2, 4]}}]):
        with pytest.raises(ValueError):
            BatchMessage.decode(json.dumps({**raw, "finished": bad}).encode())
    # Counts that do not decode pass the message (the proxy does not decode them) and are
    # refused where they are decoded, in the writer.
    garbled = [{**raw["finished"][0], "decode_counts": {"eldr_signature": "@@"}}]
    [finished] = BatchMessage.decode(json.dumps({**raw, "finished": garbled}).encode()).finished
    row = _row("b", decode=finished.decode_counts)
    with pytest.raises(ValueError, match="decode counts are malformed"):
        build_record(row)


def test_shutdown_waits_for_counts_on_their_way_and_counts_the_ones_that_never_come(
        tmp_path: Path) -> None:
    import asyncio

    from stages.serve.proxy.recording.recorder import TrafficRecorder

    recorder = TrafficRecorder(RecordConfig(tmp_path / "t.zarr"), ModelIdentity("m", 2, 4, 2),
                               "m", "v")
    signature = {wire.SIGNATURE_KEY: _row("x").prefill[wire.SIGNATURE_KEY],
                 wire.SHAPE_KEY: [2, 4]}
    for name in ("late", "never"):
        assert recorder.begin(name, signature, b"p", time.monotonic())

    async def shutdown() -> int:
        # "late"'s counts come 0.3 s into the wait, as a busy worker's publication would.
        asyncio.get_running_loop().call_later(0.3, recorder.finished, FinishedRequest.measured(
            "late", 8, 4, np.ones((2, 4), dtype=np.int32)))
        return await recorder.settle(timeout_s=1.0)

    assert asyncio.run(shutdown()) == 1
    summary = recorder.summary()
    assert (summary["waiting"], summary["unwritten"]) == (0, 1)
    assert summary["dropped"]["never_finished"] == 1
    recorder.close()
    assert SignatureDataset.open(tmp_path / "t.zarr").read().ids.tolist() == ["late"]


def _row(name: str, shape: tuple[int, int] = (2, 4), decode: dict | None = None) -> RecordedRow:
    counts = wire.encode(np.ones(shape, dtype=np.int32))
    return RecordedRow(name, counts, counts if decode is None else decode, b"p", False, 8, 4,
                       0.0, 0.1, 0.2)


def _appender(path: Path, identity: ModelIdentity, **kw: int) -> DatasetAppender:
    return DatasetAppender(path, "v", build_record, partial(identity_of, "m", identity), **kw)


def test_the_writer_appends_what_it_is_handed_and_everything_before_close(
        tmp_path: Path) -> None:
    identity = ModelIdentity("m", 2, 4, 2)
    appender = _appender(tmp_path / "t.zarr", identity)
    assert appender.put([_row(f"r{i}") for i in range(3)])
    # Generous: the writer runs at a low priority, and CI runs this beside busy vLLM engines.
    deadline = time.monotonic() + 120
    while appender.counts.appended < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(SignatureDataset.open(tmp_path / "t.zarr")) == 3  # appended, committed
    # Below serving, but not so far below that a saturated machine starves it (WRITER_NICE).
    [writer] = multiprocessing.active_children()
    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, writer.pid) == expected
    # Another model's counts, and counts that do not decode: dropped, each counted.
    appender.put([_row("r3"), _row("odd", shape=(3, 4)),
                  _row("garbled", decode={wire.SIGNATURE_KEY: "@@", wire.SHAPE_KEY: [2, 4]})])
    appender.close()
    dataset = SignatureDataset.open(tmp_path / "t.zarr")
    arrays = dataset.read()
    assert arrays.ids.tolist() == ["r0", "r1", "r2", "r3"]
    assert arrays.prompt_sha256[0] == hashlib.sha256(b"p").hexdigest()
    np.testing.assert_array_equal(arrays.decode_counts[3], np.ones((2, 4)))
    counts = appender.counts
    assert (counts.dropped_shape, counts.malformed, counts.failed) == (1, 1, 0)
    assert dataset.identity == identity


def test_a_new_dataset_takes_the_served_models_identity_else_the_first_rows() -> None:
    row = _row("r")
    record = build_record(row)
    served = ModelIdentity("served", 2, 4, 2, (1, 3))
    assert identity_of("m", served, row, record) == served
    layered = RecordedRow("r", wire.encode(record.prefill_counts * 2, (1, 3)), row.decode,
                          b"p", False, 8, 4, 0.0, 0.1, 0.2)
    # 8 picks in the first MoE layer over 8 prompt tokens: top-k 1.
    inferred = identity_of("m", None, layered, build_record(layered))
    assert inferred == ModelIdentity("m", 2, 4, 1, (1, 3))


def test_a_writer_too_far_behind_drops_and_counts(tmp_path: Path) -> None:
    identity = ModelIdentity("m", 2, 4, 2)
    appender = _appender(tmp_path / "t.zarr", identity, max_rows=4)
    results = [appender.put([_row(f"r{i}"), _row(f"s{i}")]) for i in range(50)]
    appender.close()
    assert appender.counts.dropped_full == 2 * results.count(False) > 0
    assert len(SignatureDataset.open(tmp_path / "t.zarr")) == 2 * results.count(True)


def test_a_writer_process_that_dies_is_replaced_and_its_loss_counted(tmp_path: Path) -> None:
    import multiprocessing
    import os
    import signal

    identity = ModelIdentity("m", 2, 4, 2)
    appender = _appender(tmp_path / "t.zarr", identity)
    assert appender.put([_row("r0")])
    deadline = time.monotonic() + 120  # a low-priority writer, CI beside busy engines
    while appender.counts.appended < 1:
        assert time.monotonic() < deadline, "the first row was never written"
        time.sleep(0.02)
    [writer] = multiprocessing.active_children()
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(10)
    batches = 0
    while appender.counts.appended < 2:  # a batch the dead writer took may be lost, counted
        assert time.monotonic() < deadline, appender.counts
        batches += 1
        appender.put([_row(f"s{batches}")])
        time.sleep(0.2)
    appender.close()
    counts = appender.counts
    assert counts.appended + counts.failed == 1 + batches
    assert all("terminated abruptly" in e for e in counts.errors)
    assert len(SignatureDataset.open(tmp_path / "t.zarr")) == counts.appended


def test_rows_a_stuck_writer_never_wrote_by_close_are_counted_not_only_logged(
        tmp_path: Path) -> None:
    identity = ModelIdentity("m", 2, 4, 2)
    appender = _appender(tmp_path / "t.zarr", identity)
    assert appender.put([_row("r0")])
    deadline = time.monotonic() + 120
    while appender.counts.appended < 1:
        assert time.monotonic() < deadline, "the first row was never written"
        time.sleep(0.02)
    [writer] = multiprocessing.active_children()
    os.kill(writer.pid, signal.SIGSTOP)  # alive, answering nothing
    try:
        assert appender.put([_row("s1"), _row("s2")])
        appender.close(timeout_s=1.0)
        counts = appender.counts
        assert (counts.appended, counts.failed) == (1, 2)
        assert counts.errors == ["the writer did not finish within 1 s"]
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)


def sparse_signature(body: dict) -> np.ndarray:
    """The fakes' domain signature without its floor of ones, plus an expert of the prompt's
    own: counts a fit can weigh (an expert every request picks carries no information)."""
    counts = domain_signature(body) - 1
    counts[:, 1 + len(body.get("prompt", "")) % (counts.shape[1] - 1)] += 5
    return counts


def sparse_decode(body: dict, tokens: int) -> np.ndarray:
    return sparse_signature(body) * tokens


@pytest.fixture
def recorded_workers() -> Iterator[tuple[list[BackgroundServer], list[str]]]:
    with publishing_workers(sparse_signature, sparse_decode, tokens=6) as (_, servers, endpoints):
        yield servers, endpoints


@contextmanager
def _recording_proxy(servers: list[BackgroundServer], endpoints: list[str], record: RecordConfig,
                     **kw: object) -> Iterator[BackgroundServer]:
    """A recording proxy, once its /health says ok: it heard both decode workers' batches, so
    no request's counts are published before its subscription joined (ZeroMQ's slow joiner)."""
    from stages.procs.health import wait_healthy

    config = fast_config([servers[0].url], [s.url for s in servers[1:]], policy="jsq",
                         decode_batch_endpoints=tuple(endpoints), record=record, **kw)
    with BackgroundServer(create_app(config)) as proxy:
        wait_healthy(proxy.url, 30, lambda: None, interval_s=0.05)
        yield proxy


def _prompt(i: int) -> str:
    return f"request {i} domain={i % 4}"


def test_the_proxy_records_each_request_with_what_its_decode_worker_measured(
        recorded_workers: tuple[list[BackgroundServer], list[str]], tmp_path: Path) -> None:
    servers, endpoints = recorded_workers
    path = tmp_path / "traffic.zarr"
    started = time.time()
    with _recording_proxy(servers, endpoints, RecordConfig(path)) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=30) as client:
        for i in range(12):
            body = {"prompt": _prompt(i), "max_tokens": 3 + i % 4, "stream": i % 2 == 0}
            assert client.post("/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 10
        while client.get("/admin/state").json()["recording"]["waiting"]:
            assert time.monotonic() < deadline, "the workers' counts never came"
            time.sleep(0.05)
    # The proxy stopped: every row it joined is written.
    dataset = SignatureDataset.open(path)
    arrays, traffic = dataset.read(), dataset.traffic()
    assert len(arrays) == 12 and set(arrays.domains) == {"traffic"}
    by_prompt = {}
    for row in range(12):
        sha = arrays.prompt_sha256[row]
        match = [i for i in range(12) if hashlib.sha256(_prompt(i).encode()).hexdigest() == sha]
        assert len(match) == 1
        by_prompt[match[0]] = row
    for i, row in by_prompt.items():
        body = {"prompt": _prompt(i)}
        np.testing.assert_array_equal(arrays.prefill_counts[row], sparse_signature(body))
        np.testing.assert_array_equal(arrays.decode_counts[row], sparse_decode(body, 3 + i % 4))
        assert arrays.output_tokens[row] == 3 + i % 4 and arrays.prompt_tokens[row] == 8
    assert (traffic["arrival_unix_s"] >= started - 1).all()
    assert (traffic["latency_s"] >= traffic["ttft_s"]).all() and (traffic["ttft_s"] > 0).all()
    assert set(traffic["prompt"].tolist()) == {""}  # prompts only when asked
    identity = dataset.identity
    assert (identity.num_layers, identity.num_experts) == domain_signature({}).shape


def test_sampled_recording_keeps_prompts_when_asked_and_appends_to_the_same_dataset(
        recorded_workers: tuple[list[BackgroundServer], list[str]], tmp_path: Path) -> None:
    servers, endpoints = recorded_workers
    path = tmp_path / "traffic.zarr"
    for run in range(2):
        record = RecordConfig(path, rate=0.5, prompts=True)
        with _recording_proxy(servers, endpoints, record, seed=run) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=30) as client:
            for i in range(40):
                body = {"prompt": _prompt(i), "max_tokens": 2}
                assert client.post("/v1/completions", json=body).status_code == 200
            state = client.get("/admin/state").json()["recording"]
            assert state["rate"] == 0.5
    arrays, traffic = SignatureDataset.open(path).read(), SignatureDataset.open(path).traffic()
    assert 20 <= len(arrays) <= 60  # about half of 80, from two runs into one dataset
    assert set(traffic["prompt"].tolist()) <= {_prompt(i) for i in range(40)}
    assert all(hashlib.sha256(p.encode()).hexdigest() == sha
               for p, sha in zip(traffic["prompt"], arrays.prompt_sha256, strict=True))


def test_the_recorded_dataset_is_what_eldr_fit_reads(
        recorded_workers: tuple[list[BackgroundServer], list[str]], tmp_path: Path) -> None:
    from stages.fit.fit_dataset import fit_dataset
    from stages.fit.pipeline import FitConfig
    from stages.routing.cost_model import cost_model_for

    servers, endpoints = recorded_workers
    path = tmp_path / "traffic.zarr"
    with _recording_proxy(servers, endpoints, RecordConfig(path)) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=30) as client:
        for i in range(24):
            client.post("/v1/completions", json={"prompt": _prompt(i) + "." * (i % 5),
                                                 "max_tokens": 2})
    said: list[str] = []
    artifact = fit_dataset(path, tmp_path / "store", FitConfig(k=2), "cpu", False, said.append,
                           said.append, cost_model_for=cost_model_for)
    assert artifact.centroids.shape[0] == 2
    assert artifact.dataset_hash == SignatureDataset.open(path).content_hash()


def test_recording_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    with pytest.raises(EldrError, match="--record-rate"):
        RecordConfig(tmp_path / "t.zarr", rate=0)
    with pytest.raises(EldrError, match="batch endpoint"):
        fast_config(["http://p"], ["http://d"], record=RecordConfig(tmp_path / "t.zarr"))
    record = RecordConfig(tmp_path / "t.zarr")
    with pytest.raises(EldrError, match="--proxy-workers"):
        ServeOptions(record=record, proxy_workers=2).check()
    with pytest.raises(EldrError, match="--attach-batch"):
        ServeOptions(record=record, attach_prefill=("http://p",),
                     attach_decode=("http://d",)).check()
    identity = ModelIdentity("other", 3, 4, 2)
    SignatureDataset.create_or_open(tmp_path / "o.zarr", identity, "v")
    with pytest.raises(EldrError, match="record into another path"):
        create_app(fast_config(["http://p"], ["http://d"], decode_batch_endpoints=("tcp://x:1",),
                               policy="jsq", record=RecordConfig(tmp_path / "o.zarr"),
                               self_check=ModelIdentity("m", 2, 4, 2)))
    not_a_dataset = tmp_path / "junk"
    not_a_dataset.mkdir()
    with pytest.raises(EldrError, match="zarr"):
        create_app(fast_config(["http://p"], ["http://d"], decode_batch_endpoints=("tcp://x:1",),
                               policy="jsq", record=RecordConfig(not_a_dataset)))


def test_only_recorded_requests_ask_the_decode_worker_to_measure(tmp_path: Path) -> None:
    from stages.capture.batch_publisher import BatchPublisher

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    decode = FakeBehavior("d", tokens=2, publisher=BatchPublisher(endpoint, heartbeat_s=0.2))
    with BackgroundServer(create_fake_worker(FakeBehavior("p"))) as prefill, \
            BackgroundServer(create_fake_worker(decode)) as worker:
        for record in (None, RecordConfig(tmp_path / "never-written.zarr", rate=0.001)):
            config = fast_config([prefill.url], [worker.url], decode_batch_endpoints=(endpoint,),
                                 policy="jsq", record=record)
            with BackgroundServer(create_app(config)) as proxy:
                for i in range(5):
                    httpx.post(f"{proxy.url}/v1/completions", timeout=30,
                               json={"prompt": f"x{i}", "max_tokens": 2}).raise_for_status()
    decode.publisher.close()
    sent = [r.body["kv_transfer_params"] for r in decode.received]
    assert len(sent) == 10 and not any(RECORD_KEY in kv for kv in sent)  # none sampled
    assert not store_exists(tmp_path / "never-written.zarr")  # locked for writing, no rows


def _recording_serve(servers: list[BackgroundServer], endpoints: list[str], path: Path,
                     port: int) -> subprocess.Popen[bytes]:
    """`eldr serve --attach-* --record` as a user starts it, in front of the fakes."""
    argv = [sys.executable, "-m", "eldr_cli", "serve", "--policy", "jsq", "--skip-self-check",
            "--port", str(port), "--record", "--record-to", str(path),
            "--attach-prefill", servers[0].url]
    for server, endpoint in zip(servers[1:], endpoints, strict=True):
        argv += ["--attach-decode", server.url, "--attach-batch", endpoint]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _send(url: str, prompts: range) -> None:
    for i in prompts:
        httpx.post(f"{url}/v1/completions", json={"prompt": _prompt(i), "max_tokens": 2},
                   timeout=30).raise_for_status()


def test_rows_written_survive_a_kill_9_and_a_sigterm_writes_every_row(
        recorded_workers: tuple[list[BackgroundServer], list[str]], tmp_path: Path) -> None:
    from stages.procs.health import wait_healthy

    servers, endpoints = recorded_workers
    path, port = tmp_path / "traffic.zarr", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _recording_serve(servers, endpoints, path, port)
    try:
        wait_healthy(url, 60, proc.poll, interval_s=0.1)
        _send(url, range(30))
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/admin/state").json()["recording"]["appended"] < 30:
            assert time.monotonic() < deadline, "30 rows were never written"
            time.sleep(0.1)
        _send(url, range(30, 40))  # handed over within 2 s, or not: the kill decides
        children = tree(proc.pid)  # the writer process among them
        assert children
    finally:
        proc.kill()
        proc.wait()
    left = wait_gone(children, timeout_s=15)
    assert not left, f"left behind by a kill -9: {[command(pid) for pid in left]}"
    survived = SignatureDataset.open(path).read()
    assert 30 <= len(survived) <= 40
    for row in range(len(survived)):
        i = next(i for i in range(40)
                 if hashlib.sha256(_prompt(i).encode()).hexdigest() == survived.prompt_sha256[row])
        np.testing.assert_array_equal(survived.prefill_counts[row],
                                      sparse_signature({"prompt": _prompt(i)}))

    proc = _recording_serve(servers, endpoints, path, port)
    try:
        wait_healthy(url, 60, proc.poll, interval_s=0.1)
        _send(url, range(10))
        proc.send_signal(signal.SIGTERM)  # at once: nothing handed to the writer yet
        assert proc.wait(timeout=60) == 130  # the CLI's "interrupted", after the drain
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(SignatureDataset.open(path)) == len(survived) + 10
