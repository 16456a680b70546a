"""A prompt's KV block hashes, computed as vLLM's prefix cache computes them.

vLLM hashes each full block of ``block_size`` tokens as ``hash((parent_hash, tokens,
extra_keys))``, the first block's parent being ``NONE_HASH = hash(seed)``, and publishes in its
KV events the low 64 bits of each hash read big-endian (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
on by default). Computing the same numbers here means a router can match a request against
every worker's cache exactly, not by a guessed prefix of bytes. vLLM's sha256 hashes use the
fixed seed ``"vllm-none-hash"`` unless ``PYTHONHASHSEED`` is set; its xxhash ones take a random
per-process seed unless it is, so those match only where workers and proxy share
``PYTHONHASHSEED``. A partial last block is never cached, so it has no hash.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stages.errors import EldrError

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_LOW_64 = (1 << 64) - 1


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    import cbor2  # a vLLM dependency; only the *_cbor algorithms need it

    return cbor2.dumps(value, canonical=True)


def _xxh128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError:
        raise EldrError("the workers hash blocks with xxhash: `pip install xxhash`") from None
    return xxhash.xxh3_128_digest(data)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# vLLM's --prefix-caching-hash-algo values: (serializer, digest)
_ALGOS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickled, _sha256),
    "sha256_cbor": (_cbor, _sha256),
    "xxhash": (_pickled, _xxh128),
    "xxhash_cbor": (_cbor, _xxh128),
}
HASH_ALGOS = tuple(_ALGOS)


def external_hash(value: bytes | int) -> int:
    """A block hash as KV events carry it by default (an int), whichever form it came in."""
    if isinstance(value, int):
        return value & _LOW_64
    return int.from_bytes(value, "big") & _LOW_64


@dataclass(frozen=True)
class BlockHasher:
    """vLLM's block hashing for one ``--prefix-caching-hash-algo``. ``seed``: the workers'
    ``PYTHONHASHSEED`` if they set one (None: vLLM's default for the algorithm)."""

    algo: str = "sha256"
    seed: str | None = None
    # Blocks hashed before, by (parent hash, tokens, extra keys): a conversation's next turn
    # repeats its history's blocks, whose digests are then a dict lookup, not a pickle and a
    # sha256 each (8x as many blocks at a GPU's block size of 16 as at the CPU's 128).
    max_memo: int = 1 << 18
    _none_hash: bytes = field(init=False, repr=False)
    _memo: dict[tuple[Any, ...], tuple[bytes, int]] = field(init=False, repr=False,
                                                             compare=False)

    def __post_init__(self) -> None:
        if self.algo not in _ALGOS:
            raise EldrError(f"unknown prefix-caching hash algorithm {self.algo!r}; vLLM's are"
                            f" {', '.join(HASH_ALGOS)}")
        seed = self.seed if self.seed is not None else os.environ.get("PYTHONHASHSEED")
        if seed is None:
            if self.algo.startswith("xxhash"):
                raise EldrError("xxhash block hashes use a random seed in each vLLM process:"
                                " set the same PYTHONHASHSEED for the workers and eldr")
            seed = DEFAULT_NONE_HASH_SEED
        object.__setattr__(self, "_none_hash", self._digest(seed))
        object.__setattr__(self, "_memo", {})

    def _digest(self, value: Any) -> bytes:
        serialize, digest = _ALGOS[self.algo]
        return digest(serialize(value))

    def hashes(self, token_ids: Sequence[int], block_size: int,
               cache_salt: str | None = None) -> list[int]:
        """The external hash of every full block of ``token_ids``, in order."""
        if block_size < 1:
            raise EldrError(f"block size must be >= 1, got {block_size}")
        parent = self._none_hash
        out: list[int] = []
        memo = self._memo
        if len(memo) > self.max_memo:
            memo.clear()  # cheaper than an LRU's bookkeeping per block; refilled in a turn
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            # vLLM tags the salt with its source and keys only the first block with it.
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            key = (parent, tuple(token_ids[start:start + block_size]), extra)
            known = memo.get(key)
            if known is None:
                digest = self._digest(key)
                known = memo[key] = (digest, external_hash(digest))
            parent = known[0]
            out.append(known[1])
        return out
