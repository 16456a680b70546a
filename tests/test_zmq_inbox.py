"""A ZMQ socket read from the event loop (stages.serve.proxy.view.zmq_inbox), and the KV event
follower that reads its workers' streams through it."""

from __future__ import annotations

import asyncio
import time

import msgspec
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
