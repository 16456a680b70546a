"""vLLM's KV events on the wire, as much of them as routing reads (``vllm.distributed.
kv_events``: a batch is ``[ts, events, data_parallel_rank]``, each event a map tagged by its
``type``).

Decoded into typed structs in one pass: the fields routing does not read (a ``BlockStored``'s
``token_ids`` above all: the proxy hashes prompts itself) are skipped undecoded, and a batch
either decodes whole or not at all, so a malformed one changes nothing.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from stages.routing.kv.block_hashes import external_hash

_LOW_64 = (1 << 64) - 1


class BlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[int | bytes]
    # Below 1 the proxy could hash no prompt (every request's match would fail): refused with
    # the batch, as any message that is not vLLM's.
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    parent_block_hash: int | bytes | None = None
    # Left undecoded: only a sequence's first block's first ids are read (``leading_ids``).
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


def leading_ids(token_ids: msgspec.Raw | bytes, count: int) -> tuple[int, list[int]]:
    """How many token ids an event carries, and the first ``count`` of them, read from its
    undecoded msgpack array without decoding the rest: vLLM's ``BlockStored`` carries every
    stored block's ids (a 2,000-token prompt's: 33 us to decode whole), and only the first few
    are read. Raises ValueError on anything but an array of non-negative ints."""
    data = memoryview(token_ids)
    if not data:
        return 0, []
    marker = data[0]
    if marker & 0xF0 == 0x90:
        length, at = marker & 0x0F, 1
    elif marker in (0xDC, 0xDD):
        at = 3 if marker == 0xDC else 5
        length = int.from_bytes(data[1:at], "big")
    else:
        raise ValueError(f"token ids are not a msgpack array (marker {marker:#x})")
    ids: list[int] = []
    append = ids.append
    try:
        for _ in range(min(count, length)):
            marker = data[at]
            if marker < 0x80:  # a positive fixint: the id itself
                append(marker)
                at += 1
            elif marker == 0xCD:  # uint16, most of a vocabulary
                append(data[at + 1] << 8 | data[at + 2])
                at += 3
            elif marker == 0xCC:  # uint8
                append(data[at + 1])
                at += 2
            elif marker in (0xCE, 0xCF):  # uint32, uint64
                width = 4 if marker == 0xCE else 8
                append(int.from_bytes(data[at + 1:at + 1 + width], "big"))
                at += 1 + width
            else:
                raise ValueError(f"a token id is not a non-negative int (marker {marker:#x})")
    except IndexError:
        raise ValueError("token ids cut short") from None
    if len(data) < at:
        raise ValueError("token ids cut short")
    return length, ids


def external_hashes(hashes: list[int | bytes]) -> list[int]:
    """``external_hash`` of each; ints (vLLM's default form) without a call each."""
    return [h & _LOW_64 if type(h) is int else external_hash(h) for h in hashes]
