"""Batches from the workers' streams are applied when the view is read (or soon after they
came), not as each arrives: every read sees what a view that applied each batch on arrival
sees, so routing decisions are unchanged."""

from __future__ import annotations

import asyncio

import numpy as np

from stages.serve.proxy.view import kv_events
from stages.serve.proxy.view.kv_events import KVView
from tests.test_kv_view import Clock, batch, stored

# (worker, seq, payload) as two workers' streams deliver them: stores, a removal, a duplicate
# (a replay overlapping the stream), a restarted engine, garbage, a clear.
STREAM = [
    (0, 0, batch(stored([1, 2, 3]))),
    (1, 0, batch(stored([1, 2]))),
    (0, 1, batch({"type": "BlockRemoved", "block_hashes": [3], "medium": None})),
    (0, 1, batch(stored([3]))),  # a duplicate of 1: dropped by both
    (1, 1, batch(stored([7]))),
    (1, 0, batch(stored([50]))),  # numbers started over: a new engine, its blocks cleared
    (0, 2, b"\x00not msgpack"),
    (0, 3, batch(stored([3]))),
    (1, 1, batch({"type": "AllBlocksCleared"})),
    (1, 2, batch(stored([1]))),
]


def reads(view: KVView) -> tuple[object, ...]:
    """Everything routing and the operators read of a view."""
    return (view.cached_tokens([1, 2, 3]).tolist(), view.cached_tokens([50]).tolist(),
            view.trusted().tolist(), view.state(), view.block_size, list(view.last_seq))


def test_a_view_read_after_any_batch_sees_what_applying_each_on_arrival_gives() -> None:
    async def main() -> None:
        for read_after in range(len(STREAM)):
            clock, eager_clock = Clock(), Clock()
            lazy = KVView(2, silent_after_s=5.0, clock=clock)
            eager = KVView(2, silent_after_s=5.0, clock=eager_clock)
            for i, (worker, seq, payload) in enumerate(STREAM):
                lazy.receive(worker, seq, payload)
                eager.apply(worker, seq, payload)
                if i == read_after:
                    lazy.sent(1, [1, 2, 3])  # owes the blocks it lacks, in both views
                    eager.sent(1, [1, 2, 3])
                    assert reads(lazy) == reads(eager)
            assert reads(lazy) == reads(eager)

    asyncio.run(main())


def test_received_batches_wait_for_a_read_or_are_applied_soon_after(monkeypatch) -> None:
    monkeypatch.setattr(kv_events, "FLUSH_DELAY_S", 0.01)

    async def main() -> None:
        view = KVView(1)
        view.receive(0, 0, batch(stored([1, 2])))
        assert view.index.held(0) == 0 and view.latest_seq(0) == 0  # not applied yet
        assert view.last_seq[0] is None
        await asyncio.sleep(0.05)  # nobody read the view: applied anyway
        assert view.index.held(0) == 2 and view.last_seq[0] == 0
        view.receive(0, 1, batch(stored([3])))
        assert np.array_equal(view.cached_tokens([1, 2, 3]), [12])  # a read applies it first

    asyncio.run(main())


def test_a_batch_received_again_is_dropped_before_it_waits() -> None:
    async def main() -> None:
        view = KVView(1)
        view.receive(0, 4, batch(stored([1])))
        view.receive(0, 3, batch(stored([9])))  # already received (an overlapping replay)
        view.receive(0, 4, batch(stored([9])))
        assert view.latest_seq(0) == 4
        view.flush()
        assert view.index.held(0) == 1 and view.events[0] == 1

    asyncio.run(main())


def test_a_prompt_is_matched_against_the_batches_received_before_it() -> None:
    from stages.paths import BUNDLED_MODELS_DIR
    from stages.routing.kv.block_hashes import BlockHasher
    from stages.serve.proxy.config import KVConfig
    from stages.serve.proxy.view.kv_routing import KVRouting

    async def main() -> None:
        kv = KVRouting(KVConfig(str(BUNDLED_MODELS_DIR / "tiny"), (None, None), (None,)))
        body = {"prompt": "The committee reviewed the annual report on water quality. " * 60}
        ids = kv.tokenizer.completion(body)
        assert ids is not None
        hashes = BlockHasher().hashes(ids, 32)
        event = {**stored(hashes, block_size=32), "token_ids": ids[:len(hashes) * 32]}
        # Worker 1's blocks came (block size, the first block's text): not applied yet.
        kv.prefill.receive(1, 0, batch(event))
        prompt = kv.prompt(body, chat=False)
        assert prompt is not None and prompt.hashes == hashes  # matched whole: its head is held
        assert kv.prefill.cached_tokens(prompt.reusable).tolist() == [0, len(hashes) * 32]

    asyncio.run(main())
