"""The bench's fake workers publish KV events the proxy's KV view reads: it learns their block
size and the blocks of the prompts they ran, so examples/bench_proxy.py's eldr-kv router really
tokenizes and matches (it tokenizes only once a worker told it the block size)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable

import pytest

from examples.bench_proxy import kv_event_ports
from stages.paths import BUNDLED_MODELS_DIR
from stages.serve.proxy.config import KVConfig
from stages.serve.proxy.view.kv_events import follow_kv_events
from stages.serve.proxy.view.kv_routing import KVRouting
from tests.fakes import lean_worker
from tests.fakes.kv_publisher import FakeKVPublisher, stand_in_hashes
from tests.fakes.worker import FakeBehavior

TINY = str(BUNDLED_MODELS_DIR / "tiny")


def _free_pair() -> int:
    """A port free together with the next one (the replay socket's), as the bench picks them."""
    return kv_event_ports(1, [])[0]


def _follow_prefill_events(routing: KVRouting, meanwhile: Callable[[], Awaitable[None]]) -> None:
    """The proxy's view follows the prefill workers' events while ``meanwhile`` runs."""

    async def follow() -> None:
        task = asyncio.create_task(follow_kv_events(routing.sources("prefill"), routing.prefill))
        try:
            await meanwhile()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(follow())


def test_the_proxy_view_learns_block_size_and_the_prompts_blocks_from_the_fake() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_pair()}"
    publisher = FakeKVPublisher(endpoint, TINY, block_size=32)
    routing = KVRouting(KVConfig(tokenizer=TINY, prefill_events=(endpoint,),
                                  decode_events=(None,)))
    before = {"prompt": "words of a first prompt " * 40, "max_tokens": 4}
    after = {"prompt": "another prompt, sent once the proxy listens " * 40, "max_tokens": 4}
    chat = {"messages": [{"role": "user", "content": "a chat question " * 40}]}

    async def meanwhile() -> None:
        await _until(lambda: routing.prefill.block_size is not None)
        publisher.ran(after, chat=False)
        publisher.ran(chat, chat=True)
        await _until(lambda: routing.prefill.events[0] == 3)

    try:
        publisher.ran(before, chat=False)  # before the proxy listens: only the replay has it
        _follow_prefill_events(routing, meanwhile)
    finally:
        publisher.close()
    view = routing.prefill
    assert view.block_size == 32 and view.trusted().tolist() == [True]
    for body, is_chat in ((before, False), (after, False), (chat, True)):
        prompt = routing.prompt(body, chat=is_chat)
        assert prompt is not None and len(prompt.hashes) >= 4
        # The proxy's own hashes of the prompt are the blocks the fake said it stored.
        assert view.cached_tokens(prompt.hashes).tolist() == [32 * len(prompt.hashes)]
    assert view.state()[0]["gaps"] == 0 and view.state()[0]["undecodable"] == 0


def test_stand_in_hashes_keep_the_view_trusted_and_evictions_bound_what_it_holds() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_pair()}"
    # No tokenizer: 400 characters at 4 a token are 100 tokens, three blocks of 32.
    publisher = FakeKVPublisher(endpoint, None, block_size=32, capacity=7)
    routing = KVRouting(KVConfig(tokenizer=TINY, prefill_events=(endpoint,),
                                 decode_events=(None,)))
    bodies = [{"prompt": f"{i:04d}" + "x" * 396} for i in range(5)]

    async def meanwhile() -> None:
        await asyncio.sleep(0.3)  # subscribed: no replay needed
        for body in [*bodies, bodies[-1]]:  # the last again: it holds it, stores nothing
            publisher.ran(body, chat=False)
        await _until(lambda: routing.prefill.events[0] == 5)

    try:
        _follow_prefill_events(routing, meanwhile)
    finally:
        publisher.close()
    view = routing.prefill
    assert publisher.published == 5
    assert view.block_size == 32 and view.trusted().tolist() == [True]
    assert view.index.held(0) == 7  # 15 stored, the oldest 8 removed as the fake evicted them


def test_a_step_of_prompts_is_published_as_one_batch_as_vllm_does() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_pair()}"
    publisher = FakeKVPublisher(endpoint, None, block_size=32, capacity=7, step_s=0.05)
    routing = KVRouting(KVConfig(tokenizer=TINY, prefill_events=(endpoint,),
                                 decode_events=(None,)))
    bodies = [{"prompt": f"{i:04d}" + "x" * 396} for i in range(5)]

    async def meanwhile() -> None:
        await asyncio.sleep(0.3)  # subscribed: no replay needed
        for body in bodies[:3]:  # one step
            publisher.ran(body, chat=False)
        assert publisher.published == 0  # sent when the step ends
        await _until(lambda: routing.prefill.events[0] == 1)
        for body in bodies[3:]:  # the next
            publisher.ran(body, chat=False)
        await _until(lambda: routing.prefill.events[0] == 2)

    try:
        _follow_prefill_events(routing, meanwhile)
    finally:
        publisher.close()
    assert publisher.published == 2
    assert routing.prefill.index.held(0) == 7  # 15 stored, the oldest 8 removed, in order


PROMPTS = ["one long prompt " * 25, "another long prompt " * 20]


def _through_fake_worker(publisher: FakeKVPublisher,
                         bench: Callable[[str], Awaitable[int]]) -> int:
    """``bench`` run against a lean fake worker that publishes through ``publisher`` (closed
    after): the requests it sent."""
    sock = lean_worker.listening_socket(0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"

    async def run() -> int:
        workers = await lean_worker.start([sock], [FakeBehavior("bench", record=False)],
                                          [publisher])
        try:
            return await bench(url)
        finally:
            workers[0].close()

    try:
        return asyncio.run(run())
    finally:
        publisher.close()


@pytest.mark.parametrize("unique", [True, False])
def test_the_bench_sends_new_prompts_each_time_or_the_same_ones_again(unique: bool) -> None:
    from examples.bench_proxy import _generate

    # Every new prompt makes the fake store blocks (one batch); a repeated one makes none.
    publisher = FakeKVPublisher(f"tcp://127.0.0.1:{_free_pair()}", None, block_size=32)

    async def bench(url: str) -> int:
        requests, failed, _, _ = await _generate(url, "plain", 4, 0.5, 7, PROMPTS, unique)
        assert failed == 0 and requests > 20
        return requests

    requests = _through_fake_worker(publisher, bench)
    assert publisher.published == (requests if unique else len(PROMPTS))


def test_the_bench_sends_no_point_a_new_prompt_an_earlier_point_sent() -> None:
    from examples.bench_proxy import PROMPT_NUMBERS, _generate

    # The fake holds every block sent (capacity to spare): a prompt sent again stores none.
    publisher = FakeKVPublisher(f"tcp://127.0.0.1:{_free_pair()}", None, block_size=32,
                                capacity=1 << 20)

    async def bench(url: str) -> int:
        sent = 0
        for point in range(2):
            requests, failed, _, _ = await _generate(url, "plain", 4, 0.3, 7, PROMPTS, True,
                                                     point * PROMPT_NUMBERS)
            assert failed == 0 and requests > 10
            sent += requests
        return sent

    requests = _through_fake_worker(publisher, bench)
    assert publisher.published == requests  # the second point's prompts were new too


def test_stand_in_hashes_are_a_texts_own_in_every_process() -> None:
    # A prompt's prefill and decode workers run in two fake processes: their stand-in blocks
    # must be the same blocks, as vLLM's hashes are on every worker (the view reads a first
    # block once whichever workers store it).
    code = ("from tests.fakes.kv_publisher import stand_in_hashes;"
            " print(stand_in_hashes('a prompt of some length ' * 40, 16, 4.0))")
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert seen == {f"{stand_in_hashes('a prompt of some length ' * 40, 16, 4.0)}\n"}


async def _until(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the view did not get there")


def test_the_bench_measures_a_kv_router_once_its_view_has_caught_up() -> None:
    """A KV-aware router replays each fake's buffered batches when it starts: the bench waits
    until its view's event counts stop moving, or says it never did."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from examples.bench_proxy import wait_kv_caught_up

    polls = [0]
    settles_after = [5]  # polls during which the counts still grow

    class State(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            polls[0] += 1
            events = min(polls[0], settles_after[0])
            body = json.dumps({"kv": {"prefill": [{"events": events}],
                                      "decode": [{"events": 2 * events}]}}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), State)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        waited = wait_kv_caught_up(url, timeout_s=10.0, quiet_s=0.3)
        assert polls[0] >= 5 + 3 and 0.3 <= waited < 5.0
        settles_after[0] = 10**9  # never settles
        with pytest.raises(SystemExit, match="still applying events"):
            wait_kv_caught_up(url, timeout_s=0.5, quiet_s=0.3)
    finally:
        server.shutdown()
        server.server_close()
