"""A ZMQ socket read from the event loop (stages.serve.proxy.view.zmq_inbox), and the KV event
follower that reads its workers' streams through it."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from stages.serve.proxy.view.kv_events import KVEventSource, KVView, follow_kv_events
from stages.serve.proxy.view.zmq_inbox import ZmqInbox

ENCODE = msgspec.msgpack.Encoder().encode


def stored(hashes: list[int]) -> bytes:
    return ENCODE([0.0, [{"type": "BlockStored", "block_hashes": hashes,
                          "parent_block_hash": None, "token_ids": [], "block_size": 16,
                          "lora_id": None, "medium": "GPU", "lora_name": None}], None])


def test_the_inbox_waits_for_a_message_and_times_out_without_one(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/inbox"

    async def run() -> tuple[bool, bool, list[bytes], bool]:
        context = zmq.Context.instance()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.bind(endpoint)
        pull = zmq.Socket(context, zmq.PULL)
        pull.connect(endpoint)
        inbox = ZmqInbox(pull)
        try:
            nothing = await inbox.wait(0.1)
            # A message sent while the wait is parked wakes it.
            asyncio.get_running_loop().call_later(0.05, push.send_multipart, (b"a", b"b"))
            woken = await inbox.wait(5.0)
            message = inbox.recv()
            drained = await inbox.wait(0.05)
            return nothing, woken, message, drained
        finally:
            inbox.close()
            push.close()

    assert asyncio.run(run()) == (False, True, [b"a", b"b"], False)


def test_the_follower_applies_a_burst_queued_while_the_loop_was_busy(tmp_path) -> None:
    """Batches that piled up while the loop ran other work are all applied, in order, when it
    gets back to them; then it waits for the next as before."""
    endpoint = f"ipc://{tmp_path}/ev"
    burst = 3000

    async def run() -> KVView:
        context = zmq.Context.instance()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind(endpoint)
        view = KVView(1)
        task = asyncio.create_task(follow_kv_events([KVEventSource(endpoint, None)], view))
        try:
            # Subscribed once a probe batch arrives (a SUB misses what precedes its join).
            for _ in range(200):
                pub.send_multipart((b"kv", (0).to_bytes(8, "big"), stored([0])))
                await asyncio.sleep(0.01)
                if view.last_seq[0] == 0:
                    break
            for seq in range(1, burst + 1):
                pub.send_multipart((b"kv", seq.to_bytes(8, "big"), stored([seq])))
            time.sleep(0.5)  # the loop is busy elsewhere: the burst queues up
            await _until(lambda: view.last_seq[0] == burst)
            pub.send_multipart((b"kv", (burst + 1).to_bytes(8, "big"), stored([burst + 1])))
            await _until(lambda: view.last_seq[0] == burst + 1)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close()
        return view

    view = asyncio.run(run())
    assert view.index.held(0) == burst + 2
    assert view.gaps[0] == 0 and view.undecodable[0] == 0


async def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_batches_sent_while_a_gap_is_replayed_are_read_after_it_in_order(tmp_path) -> None:
    """At a gap the stream stops reading (its batch after the gap held) while the replay runs;
    the batches queued behind it are read once the replay ended, the held one not applied
    twice."""
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    sent: dict[int, bytes] = {}
    done = threading.Event()
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(replay)

    def answer_replays() -> None:
        while not done.is_set():
            if not router.poll(50):
                continue
            client, _, start = router.recv_multipart()
            first = int.from_bytes(start, "big")
            if first > 0:
                time.sleep(0.3)  # the stream goes on meanwhile
            for seq in sorted(s for s in sent if s >= first):
                router.send_multipart((client, b"", b"kv", seq.to_bytes(8, "big"), sent[seq]))
            router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    async def run() -> KVView:
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(endpoint)

        def publish(seq: int, on_stream: bool = True) -> None:
            sent[seq] = stored([seq])
            if on_stream:
                pub.send_multipart((b"kv", seq.to_bytes(8, "big"), sent[seq]))

        view = KVView(1)
        task = asyncio.create_task(follow_kv_events([KVEventSource(endpoint, replay)], view))
        try:
            for _ in range(200):  # subscribed once a probe batch arrives
                publish(0)
                await asyncio.sleep(0.01)
                if view.last_seq[0] == 0:
                    break
            # 1 is lost on the way (only the replay has it); what follows 2 is queued when
            # the gap is seen, and nothing more comes: it must be read without a wake-up.
            publish(1, on_stream=False)
            for seq in range(2, 51):
                publish(seq)
            time.sleep(0.2)  # the loop busy elsewhere: all of them queue before it reads
            await _until(lambda: view.last_seq[0] == 50)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close()
        return view

    thread = threading.Thread(target=answer_replays, daemon=True)
    thread.start()
    try:
        view = asyncio.run(run())
    finally:
        done.set()
        thread.join()
        router.close(linger=0)
    assert view.index.held(0) == 51
    assert (view.gaps[0], view.lost[0], view.undecodable[0]) == (1, 0, 0)
    assert view.events[0] == 51  # every batch applied once


def test_a_failure_while_reading_the_stream_ends_the_follower_with_it(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/ev"

    class Failing(KVView):
        def receive(self, worker: int, seq: int, payload: bytes) -> None:
            raise RuntimeError(f"broken at {seq}")

    async def run() -> None:
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(endpoint)
        task = asyncio.create_task(
            follow_kv_events([KVEventSource(endpoint, None)], Failing(1)))
        try:
            for _ in range(500):
                pub.send_multipart((b"kv", (0).to_bytes(8, "big"), stored([0])))
                await asyncio.sleep(0.01)
                if task.done():
                    break
            await task
        finally:
            task.cancel()
            pub.close()

    with pytest.raises(RuntimeError, match="broken at 0"):
        asyncio.run(run())
