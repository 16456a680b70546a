"""vLLM's KV events on the wire, as much of them as routing reads (``vllm.distributed.
kv_events``: a batch is ``[ts, events, data_parallel_rank]``, each event a map tagged by its
``type``).

Decoded into typed structs in one pass: the fields routing does not read (a ``BlockStored``'s
``token_ids`` above all: the proxy hashes prompts itself) are skipped undecoded, and a batch
either decodes whole or not at all, so a malformed one changes nothing.
"""

from __future__ import annotations

import msgspec

from stages.routing.kv.block_hashes import external_hash

_LOW_64 = (1 << 64) - 1


class BlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[int | bytes]
    block_size: int
    parent_block_hash: int | bytes | None = None
    # Left undecoded: read only for a sequence's first block (``first_ids``).
    token_ids: msgspec.Raw = msgspec.Raw()
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[int | bytes]
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError on anything but a KV event batch (an event of an unknown
    type included: it may have changed blocks the index would not know of)."""
    return _DECODER.decode(payload)


_IDS = msgspec.msgpack.Decoder(list[int])


def first_ids(event: BlockStored) -> list[int]:
    """The token ids of this event's first block (none where it carries none)."""
    return _IDS.decode(event.token_ids)[:event.block_size] if event.token_ids else []


def external_hashes(hashes: list[int | bytes]) -> list[int]:
    """``external_hash`` of each; ints (vLLM's default form) without a call each."""
    return [h & _LOW_64 if type(h) is int else external_hash(h) for h in hashes]
