"""The signature dataset: the one module that reads and writes eldr's zarr stores.

Layout (zarr v3 group, every array chunked along ``request`` and compressed):

- ``prefill_counts`` int32 ``[request, layer, expert]``: prompt tokens whose top-k picked the
  expert (the request's prefill signature, as delivered to the proxy).
- ``decode_counts``  int32 ``[request, layer, expert]``: the same over generated tokens.
- ``prompt_tokens``, ``output_tokens`` int32 ``[request]``.
- ``id``, ``domain``, ``prompt_sha256`` strings ``[request]``.
- Traffic columns (``TRAFFIC_ARRAYS``), what `eldr serve --record` knows of a live request:
  ``arrival_unix_s`` float64, ``ttft_s`` and ``latency_s`` float32 (NaN where unknown, as in
  a capture), ``prompt`` string (empty unless prompts were asked for). A store written before
  they existed gets them, filled as unknown, when it is next opened for appending.

Group attributes hold the schema version, the model identity (name, L, E, top_k, MoE layer
indices), the vLLM version and ``committed``: the number of complete rows. Appends write the
arrays first and bump ``committed`` last, so a run killed mid-append leaves rows beyond
``committed`` that the next open trims: nothing half-written is ever read, and nothing
committed is lost. Because a writable open trims, a store has one writer at a time
(``writer_lock``: a second is refused, naming the first's pid); readers take no lock.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from stages.errors import EldrError
from stages.signature.writer_lock import LOCK_NAME, WriterLock

SCHEMA_VERSION = 1
SCHEMA_NAME = "eldr.signatures"
CHUNK_ROWS = 256
COUNT_ARRAYS = ("prefill_counts", "decode_counts")
SCALAR_ARRAYS = ("prompt_tokens", "output_tokens")
STRING_ARRAYS = ("id", "domain", "prompt_sha256")
# Not part of content_hash: they describe when and how fast a request was served, which does
# not change what a fit learns from its counts.
TRAFFIC_ARRAYS = {"arrival_unix_s": "float64", "ttft_s": "float32", "latency_s": "float32",
                  "prompt": str}


@dataclass(frozen=True)
class ModelIdentity:
    """What a signature means: which model, which MoE layers, how many experts and picks.

    ``num_layers`` is L, the signature's MoE layers; ``moe_layers`` are their transformer layer
    indices (a model with dense layers, e.g. DeepSeek's first layer, has fewer MoE layers than
    transformer layers). Empty means layers ``0..L-1``, as identities written before the
    indices were recorded read back.
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        layers = tuple(int(i) for i in self.moe_layers) or tuple(range(self.num_layers))
        if len(layers) != self.num_layers:
            raise ValueError(
                f"{self.name}: {len(layers)} MoE layer indices for L={self.num_layers}"
            )
        object.__setattr__(self, "moe_layers", layers)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelIdentity:
        return cls(**{**data, "moe_layers": tuple(data.get("moe_layers") or ())})

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "moe_layers": list(self.moe_layers)}

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_layers, self.num_experts)

    def describe(self) -> str:
        dense = ""
        if self.moe_layers != tuple(range(self.num_layers)):
            dense = f", MoE layers {_ranges(self.moe_layers)}"
        return (
            f"{self.name} (L={self.num_layers}, E={self.num_experts}, top_k={self.top_k}{dense})"
        )


def _ranges(indices: Sequence[int]) -> str:
    """``(1, 2, 3, 5)`` -> ``"1-3,5"``."""
    parts: list[str] = []
    start = prev = indices[0]
    for i in (*indices[1:], None):
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if i is not None:
            start = prev = i
    return ",".join(parts)


@dataclass(frozen=True)
class CaptureRecord:
    id: str
    domain: str
    prompt_sha256: str
    prompt_tokens: int
    output_tokens: int
    prefill_counts: np.ndarray  # [L, E]
    decode_counts: np.ndarray  # [L, E]
    # A recorded live request's (TRAFFIC_ARRAYS); a capture knows none of them.
    arrival_unix_s: float = float("nan")
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    prompt: str = ""


@dataclass(frozen=True)
class SignatureArrays:
    """A dataset read into memory."""

    ids: np.ndarray
    domains: np.ndarray
    prompt_sha256: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    prefill_counts: np.ndarray  # int32 [N, L, E]
    decode_counts: np.ndarray  # int32 [N, L, E]; float64 in a locality blend (stages.bench)

    def __len__(self) -> int:
        return len(self.ids)


def prompt_digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


class SignatureDataset:
    """An open signature store. Create with :meth:`create_or_open`, read with :meth:`open`."""

    def __init__(self, group: zarr.Group, path: Path, lock: WriterLock | None = None) -> None:
        self._group = group
        self.path = path
        self._lock = lock  # held by a writable open (None: a reader, or covered by a parent's)
        attrs = group.attrs.asdict()
        self.identity = ModelIdentity.from_dict(attrs["model"])
        self.vllm_version = str(attrs.get("vllm_version", "unknown"))

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, path: Path, writable: bool = False,
             on_behalf_of: int | None = None) -> SignatureDataset:
        """``writable`` takes the store's writer lock until :meth:`close` or this process's
        exit; ``on_behalf_of``: see :meth:`WriterLock.take_unless_held_by`."""
        path = Path(path)
        if not store_exists(path):
            raise EldrError(
                f"no signature dataset at {path}; run `eldr capture` first (or pass --data)"
            )
        try:
            # Our own reads never trust consolidated metadata: a run killed mid-append leaves it
            # one append behind the arrays (it is rewritten after every commit, for xarray).
            group = zarr.open_group(
                str(path), mode="r+" if writable else "r", use_consolidated=False
            )
        except Exception as exc:  # zarr raises many types for a damaged store
            raise EldrError(f"{path} is not a readable zarr signature dataset: {exc}") from exc
        attrs = group.attrs.asdict()
        if attrs.get("schema") != SCHEMA_NAME:
            raise EldrError(f"{path} is not an eldr signature dataset (no '{SCHEMA_NAME}' schema)")
        if attrs.get("schema_version") != SCHEMA_VERSION:
            raise EldrError(
                f"{path} has schema version {attrs.get('schema_version')}, this eldr reads"
                f" version {SCHEMA_VERSION}; capture into a new path"
            )
        try:
            dataset = cls(group, path)
            dataset._check_arrays()
        except (KeyError, TypeError, ValueError) as exc:
            raise EldrError(f"{path} is damaged: {exc}") from exc
        if writable:
            dataset._lock = _writer_lock(path, on_behalf_of)
            try:
                dataset._trim_uncommitted()
            except BaseException:
                dataset.close()
                raise
        return dataset

    @classmethod
    def create_or_open(
        cls, path: Path, identity: ModelIdentity, vllm_version: str,
        on_behalf_of: int | None = None,
    ) -> SignatureDataset:
        """Open for appending; refuse (never overwrite) a store of another model."""
        path = Path(path)
        if not store_exists(path):
            lock = _writer_lock(path, on_behalf_of)
            if not (path / "zarr.json").exists():  # not created by a writer before us
                try:
                    return cls._create(path, identity, vllm_version, lock)
                except BaseException:
                    if lock is not None:
                        lock.release()
                    raise
            if lock is not None:
                lock.release()  # the open of the store that exists takes it again
        dataset = cls.open(path, writable=True, on_behalf_of=on_behalf_of)
        if dataset.identity != identity:
            dataset.close()
            raise EldrError(
                f"{path} holds signatures of {dataset.identity.describe()}, not of"
                f" {identity.describe()}; choose another --out path"
            )
        return dataset

    @classmethod
    def _create(cls, path: Path, identity: ModelIdentity, vllm_version: str,
                lock: WriterLock | None) -> SignatureDataset:
        # "a", not "w-": the directory holds our lock file; no group is there (checked
        # under the lock), so nothing is overwritten.
        group = zarr.open_group(str(path), mode="a", zarr_format=3)
        group.attrs.update(
            {
                "schema": SCHEMA_NAME,
                "schema_version": SCHEMA_VERSION,
                "model": identity.to_dict(),
                "vllm_version": vllm_version,
                "committed": 0,
            }
        )
        num_layers, num_experts = identity.shape
        for name in COUNT_ARRAYS:
            group.create_array(
                name,
                shape=(0, num_layers, num_experts),
                dtype="int32",
                chunks=(CHUNK_ROWS, num_layers, num_experts),
                dimension_names=["request", "layer", "expert"],
                attributes={"description": f"{name.split('_')[0]} top-k counts per expert"},
            )
        for name in SCALAR_ARRAYS:
            group.create_array(
                name, shape=(0,), dtype="int32", chunks=(CHUNK_ROWS * 16,),
                dimension_names=["request"],
            )
        for name in STRING_ARRAYS:
            group.create_array(
                name, shape=(0,), dtype=str, chunks=(CHUNK_ROWS * 16,),
                dimension_names=["request"],
            )
        _add_traffic_arrays(group, 0)
        _consolidate(group)
        return cls(group, path, lock)

    def close(self) -> None:
        """Let another writer in (a reader's close does nothing)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._group.attrs["committed"])

    def ids(self) -> set[str]:
        n = len(self)
        return set(self._group["id"][:n].tolist()) if n else set()

    def read(self) -> SignatureArrays:
        n = len(self)
        if n == 0:
            raise EldrError(f"{self.path} holds no signatures yet; run `eldr capture`")
        try:
            columns = {name: np.asarray(self._group[name][:n]) for name in (
                "id", "domain", "prompt_sha256", "prompt_tokens", "output_tokens",
                "prefill_counts", "decode_counts")}
        except Exception as exc:  # a damaged chunk: zarr and its codecs raise many types
            raise EldrError(f"{self.path} is damaged: cannot read its rows: {exc!r}") from exc
        return SignatureArrays(
            ids=columns["id"], domains=columns["domain"],
            prompt_sha256=columns["prompt_sha256"], prompt_tokens=columns["prompt_tokens"],
            output_tokens=columns["output_tokens"], prefill_counts=columns["prefill_counts"],
            decode_counts=columns["decode_counts"],
        )

    def traffic(self) -> dict[str, np.ndarray]:
        """The committed rows' traffic columns (``TRAFFIC_ARRAYS``); a store written before
        they existed reads as unknown (NaN, empty prompts)."""
        n = len(self)
        out: dict[str, np.ndarray] = {}
        for name, dtype in TRAFFIC_ARRAYS.items():
            present = name in self._group
            out[name] = np.asarray(self._group[name][:n]) if present else _unknown(dtype, n)
        return out

    def content_hash(self) -> str:
        """sha256 over the committed rows, in order: identifies the data an artifact saw."""
        digest = hashlib.sha256()
        digest.update(repr(asdict(self.identity)).encode())
        n = len(self)
        for name in COUNT_ARRAYS + SCALAR_ARRAYS:
            digest.update(np.ascontiguousarray(self._group[name][:n]).tobytes())
        for name in STRING_ARRAYS:
            digest.update("\0".join(self._group[name][:n].tolist()).encode())
        return digest.hexdigest()

    # -- writing -------------------------------------------------------------------------
    def append(self, records: Sequence[CaptureRecord]) -> None:
        if not records:
            return
        shape = self.identity.shape
        for record in records:
            for counts in (record.prefill_counts, record.decode_counts):
                if counts.shape != shape:
                    raise ValueError(f"record {record.id}: counts {counts.shape} != {shape}")
        n = len(self)
        columns: dict[str, np.ndarray] = {
            "prefill_counts": np.stack([r.prefill_counts for r in records]).astype(np.int32),
            "decode_counts": np.stack([r.decode_counts for r in records]).astype(np.int32),
            "prompt_tokens": np.array([r.prompt_tokens for r in records], dtype=np.int32),
            "output_tokens": np.array([r.output_tokens for r in records], dtype=np.int32),
            "id": np.array([r.id for r in records], dtype=object),
            "domain": np.array([r.domain for r in records], dtype=object),
            "prompt_sha256": np.array([r.prompt_sha256 for r in records], dtype=object),
            "arrival_unix_s": np.array([r.arrival_unix_s for r in records], dtype=np.float64),
            "ttft_s": np.array([r.ttft_s for r in records], dtype=np.float32),
            "latency_s": np.array([r.latency_s for r in records], dtype=np.float32),
            "prompt": np.array([r.prompt for r in records], dtype=object),
        }
        for name, values in columns.items():
            array = self._group[name]
            array.resize((n + len(records), *array.shape[1:]))
            array[n:] = values
        self._group.attrs["committed"] = n + len(records)
        _consolidate(self._group)

    def _check_arrays(self) -> None:
        for name in COUNT_ARRAYS:
            if tuple(self._group[name].shape[1:]) != self.identity.shape:
                raise ValueError(f"{name} shape {self._group[name].shape} != model shape")
        n = len(self)
        for name in COUNT_ARRAYS + SCALAR_ARRAYS + STRING_ARRAYS:
            if self._group[name].shape[0] < n:
                raise ValueError(f"{name} has fewer rows than the {n} committed")

    def _trim_uncommitted(self) -> None:
        n = len(self)
        _add_traffic_arrays(self._group, n)
        for name in COUNT_ARRAYS + SCALAR_ARRAYS + STRING_ARRAYS + tuple(TRAFFIC_ARRAYS):
            array = self._group[name]
            if array.shape[0] > n:
                array.resize((n, *array.shape[1:]))
            elif array.shape[0] < n:
                # A traffic column behind the commit pointer (a run killed between its writes
                # and the pointer's, by a release that wrote it last): unknown for those rows.
                old = array.shape[0]
                array.resize((n,))
                array[old:] = _unknown(TRAFFIC_ARRAYS[name], n - old)
        _consolidate(self._group)


def _writer_lock(path: Path, on_behalf_of: int | None) -> WriterLock | None:
    if on_behalf_of is None:
        return WriterLock.take(path)
    return WriterLock.take_unless_held_by(path, on_behalf_of)


def store_exists(path: Path) -> bool:
    """Whether ``path`` is more than absent or a directory holding only a writer's lock file
    (a writer that took the lock and died before it created the store)."""
    if not path.is_dir():
        return path.exists()
    return {entry.name for entry in path.iterdir()} != {LOCK_NAME}


def _unknown(dtype: Any, n: int) -> np.ndarray:
    return np.full(n, "", dtype=object) if dtype is str else np.full(n, np.nan, dtype=dtype)


def _add_traffic_arrays(group: zarr.Group, rows: int) -> None:
    """Create the traffic columns a store lacks, ``rows`` long and unknown."""
    for name, dtype in TRAFFIC_ARRAYS.items():
        if name in group:
            continue
        array = group.create_array(
            name, shape=(rows,), dtype=dtype, chunks=(CHUNK_ROWS * 16,),
            dimension_names=["request"], fill_value="" if dtype is str else np.nan,
        )
        if rows:
            array[:] = _unknown(dtype, rows)


def _consolidate(group: zarr.Group) -> None:
    """Rewrite the consolidated metadata (what xarray opens first) after a commit."""
    with warnings.catch_warnings():
        # zarr notes that consolidated metadata is not yet in the v3 spec; xarray relies on it.
        warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
        # The writer's lock file is no zarr node; zarr's walk of the group notes it.
        warnings.filterwarnings("ignore", message=f"Object at {LOCK_NAME} is not recognized")
        zarr.consolidate_metadata(group.store)
