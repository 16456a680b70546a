"""vLLM's KV event batches as the proxy's view decodes them: vLLM's own structs on the wire,
what routing does not read skipped, and a batch applied whole or not at all."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from stages.routing.kv.block_hashes import external_hash
from stages.routing.kv.event_messages import decode_batch, external_hashes, leading_ids
from stages.serve.proxy.view.kv_events import KVView

ENCODE = msgspec.msgpack.Encoder().encode


def vllm_stored(hashes: list[int | bytes], group_idx: int | None = None) -> BlockStored:
    # Every field vLLM 0.32 fills, token ids and extra keys included: the view skips them.
    return BlockStored(block_hashes=hashes, parent_block_hash=None,
                       token_ids=list(range(16 * len(hashes))), block_size=16, lora_id=None,
                       medium="GPU", lora_name=None, extra_keys=[("salt",)] * len(hashes),
                       group_idx=group_idx, session_id="s-1")


def test_vllms_own_batches_decode_with_every_event_type() -> None:
    payload = ENCODE(KVEventBatch(ts=1.5, events=[
        vllm_stored([1, 2]), BlockRemoved(block_hashes=[2], medium="GPU"), AllBlocksCleared()],
        data_parallel_rank=0))
    batch = decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert batch.events[0].block_hashes == [1, 2] and batch.events[0].block_size == 16


def test_the_view_applies_vllms_batches_as_before() -> None:
    view = KVView(2)
    digest = bytes(range(32))  # a hash in bytes form: read as its low 64 bits
    view.apply(0, 0, ENCODE(KVEventBatch(ts=0.0, events=[vllm_stored([7, digest])])))
    view.apply(1, 0, ENCODE(KVEventBatch(ts=0.0, events=[vllm_stored([7], group_idx=0)])))
    key = external_hash(digest)
    assert view.block_size == 16
    assert view.cached_tokens([7, key]).tolist() == [32, 16]
    # Another KV cache group's blocks (a hybrid model's) are not the prefix cache's.
    view.apply(1, 1, ENCODE(KVEventBatch(ts=0.0, events=[vllm_stored([8], group_idx=1)])))
    view.apply(0, 1, ENCODE(KVEventBatch(ts=0.0, events=[
        BlockRemoved(block_hashes=[key], medium="GPU", group_idx=1)])))
    assert view.cached_tokens([7, key]).tolist() == [32, 16]
    assert view.cached_tokens([8]).tolist() == [0, 0]
    view.apply(0, 2, ENCODE(KVEventBatch(ts=0.0, events=[
        BlockRemoved(block_hashes=[key], medium="GPU")])))
    assert view.cached_tokens([7, key]).tolist() == [16, 16]
    view.apply(1, 2, ENCODE(KVEventBatch(ts=0.0, events=[AllBlocksCleared()])))
    assert view.cached_tokens([7]).tolist() == [16, 0]
    assert view.undecodable.tolist() == [0, 0] and view.last_seq == [2, 2]


def test_a_batch_with_an_event_it_cannot_read_changes_nothing() -> None:
    view = KVView(1)
    view.apply(0, 0, ENCODE([0.0, [msgspec.to_builtins(vllm_stored([1]))], None]))
    bad = ENCODE([0.0, [msgspec.to_builtins(vllm_stored([2])), {"type": "BlockMoved"}], None])
    view.apply(0, 1, bad)
    # Not even the stored block before the unknown event: the batch may have removed others.
    assert view.cached_tokens([1, 2]).tolist() == [16]
    assert view.undecodable[0] == 1 and view.last_seq[0] == 0
    for garbage in (b"\x00", ENCODE([0.0, [{"type": "BlockStored"}], None]),
                    ENCODE([0.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}], None])):
        view.apply(0, 1, garbage)
    assert view.undecodable[0] == 4 and view.cached_tokens([1]).tolist() == [16]


@pytest.mark.parametrize("value", [0, 1 << 63, (1 << 64) - 1, -1, b"\x01" * 32, b"\x02"])
def test_hashes_read_as_external_hash_reads_them(value: int | bytes) -> None:
    assert external_hashes([value]) == [external_hash(value)]


@pytest.mark.parametrize("length", [0, 3, 15, 16, 200, 70_000])
def test_an_events_leading_token_ids_read_as_decoding_them_all_would(length: int) -> None:
    # Every msgpack width an id takes (fixint, uint8, 16, 32, 64) and every array header.
    widths = [5, 200, 40_000, 3_000_000, 1 << 40]
    ids = [widths[i % len(widths)] + i for i in range(length)]
    raw = msgspec.Raw(ENCODE(ids))
    for count in (0, 1, 16, length, length + 5):
        assert leading_ids(raw, count) == (length, ids[:count])


@pytest.mark.parametrize("payload", [[1, -2, 3], [1, "a"], {"a": 1}, 7, [1.5]])
def test_token_ids_that_are_no_list_of_ids_are_refused(payload: object) -> None:
    with pytest.raises(ValueError):
        leading_ids(msgspec.Raw(ENCODE(payload)), 8)


def test_token_ids_cut_short_are_refused() -> None:
    whole = ENCODE([1, 300, 70_000])
    for cut in range(1, len(whole)):
        with pytest.raises(ValueError):
            leading_ids(whole[:cut], 3)
