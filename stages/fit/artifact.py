"""The artifact store: immutable, content-addressed fits that serve loads and checks.

Layout under ``root``::

    <version>/manifest.json   identity, dataset hash, params, metrics, array shapes, content hash,
                              provenance (versions, command: outside the hash)
    <version>/arrays.npz      centroids float32 [K, D], idf float32 [L, E], layer_mask bool [L],
                              optionally the token predictor's (``token_predictor.*``)
    latest                    text file: the version serve uses by default

``version`` is the first 12 hex digits of a SHA-256 over everything that defines the fit (the
arrays' bytes, identity, dataset hash, params, metrics), not over the creation time, so the same
fit saved twice is one version. A version directory is written under a temporary name and
renamed into place, and ``latest`` is replaced atomically, so readers never see half an
artifact. Loading never unpickles (``allow_pickle=False``), re-checks the content hash and
validates every shape; any problem is an ``EldrError`` naming the artifact.

The token predictor (``stages.signature.token_predictor``: a prompt's signature at arrival) is
an optional, versioned entry: a manifest key ``token_predictor`` (its format and sizes) and its
arrays, both inside the hash. A fit without one has exactly the content, hence the version and
bytes, it had before the entry existed, and artifacts saved before it load with no predictor.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from stages.errors import EldrError
from stages.signature.dataset import ModelIdentity
from stages.signature.token_predictor import ARRAY_NAMES as PREDICTOR_ARRAYS
from stages.signature.token_predictor import TokenPredictor
from stages.signature.transform import SignatureTransform

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
ARRAYS = "arrays.npz"
LATEST = "latest"
_VERSION_RE = re.compile(r"^[0-9a-f]{12}$")
_CONTENT_KEYS = ("schema", "identity", "dataset_hash", "params", "metrics", "arrays")
_ARRAY_DTYPES = {"centroids": np.float32, "idf": np.float32, "layer_mask": np.bool_}
# The optional token predictor: its manifest key, the one format this eldr reads, its arrays'
# prefix in arrays.npz.
PREDICTOR_KEY = "token_predictor"
PREDICTOR_FORMAT = 1
_PREDICTOR_PREFIX = f"{PREDICTOR_KEY}."


@dataclass(frozen=True, eq=False)
class Artifact:
    version: str
    centroids: np.ndarray  # float32 [K, D], unit rows; row k is decode worker k's centroid
    transform: SignatureTransform
    identity: ModelIdentity
    dataset_hash: str
    params: dict[str, Any]
    metrics: dict[str, Any]
    created: str  # ISO 8601, UTC
    # What produced it (stages.provenance.KEYS): stored beside the content, not hashed.
    provenance: dict[str, Any] = field(default_factory=dict)
    # A prompt's signature at arrival; None in fits without one (and those saved before it).
    token_predictor: TokenPredictor | None = None

    @property
    def num_clusters(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def dim(self) -> int:
        return int(self.centroids.shape[1])


@dataclass(frozen=True)
class ArtifactSummary:
    version: str
    created: str
    model: str
    num_clusters: int
    dim: int
    dataset_hash: str
    latest: bool
    problem: str | None = None  # why load() refuses it (damaged manifest, arrays or hash)

    def describe(self) -> str:
        """One line for ``eldr artifacts list``; '*' marks ``latest``."""
        mark = "*" if self.latest else " "
        if self.problem is not None:
            return f"{mark} {self.version}  DAMAGED: {self.problem}"
        return (
            f"{mark} {self.version}  {self.created}  k={self.num_clusters} D={self.dim}  "
            f"{self.model}  data {self.dataset_hash[:12]}"
        )


def check_identity(artifact: Artifact, identity: ModelIdentity) -> None:
    """Refuse an artifact fit for another model (signatures would mean something else)."""
    if artifact.identity != identity:
        raise EldrError(
            f"artifact {artifact.version} was fit for {artifact.identity.describe()}, but the "
            f"served model is {identity.describe()}; fit one on signatures captured from "
            f"{identity.name} (`eldr fit`) or pass the matching artifact"
        )


def load_for_serving(
    store: Path, version: str, identity: ModelIdentity, num_decode: int
) -> Artifact:
    """The artifact ELDR routes ``num_decode`` workers of the model ``identity`` with.

    One place for the checks ``eldr serve`` and ``eldr bench --simulate`` both need: a fit
    exists, it is for this model, and it has at least one centroid per decode worker (more are
    spread over the workers: ``stages.routing.policies.cluster_map``).
    """
    if not store.exists() or not any(store.iterdir()):
        raise EldrError(
            f"ELDR needs a fitted artifact and {store} has none: run `eldr capture` then"
            f" `eldr fit --k {num_decode} --balanced` (one cluster per decode worker), or use a"
            " load-only policy (jsq)"
        )
    artifact = ArtifactStore(store).load(version)
    check_identity(artifact, identity)
    check_cluster_count(artifact.centroids.shape[0], num_decode, artifact.version)
    return artifact


def check_cluster_count(num_clusters: int, num_workers: int, version: str = "") -> None:
    """Every decode worker needs at least one cluster to serve."""
    if num_clusters < num_workers:
        raise EldrError(
            f"artifact {version + ' ' if version else ''}has {num_clusters} centroids for"
            f" {num_workers} decode workers: every worker needs at least one cluster; fit with"
            f" `eldr fit --k {num_workers} --balanced` (or more clusters), or start fewer"
            " decode workers"
        )


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # -- writing -------------------------------------------------------------------------

    def save(
        self,
        *,
        centroids: np.ndarray,
        transform: SignatureTransform,
        identity: ModelIdentity,
        dataset_hash: str,
        params: dict[str, Any],
        metrics: dict[str, Any],
        provenance: dict[str, Any] | None = None,
        set_latest: bool = True,
        token_predictor: TokenPredictor | None = None,
    ) -> str:
        """Write a new version (or find the identical existing one); return its version.

        Content-addressed: the same content is the same version and the same bytes wherever
        and whenever it is saved. ``provenance`` (the versions and command that produced it)
        is kept in the manifest outside the hash; the time of the save is the version
        directory's, not in any file."""
        arrays = {
            "centroids": np.ascontiguousarray(centroids, dtype=np.float32),
            "idf": np.ascontiguousarray(transform.idf, dtype=np.float32),
            "layer_mask": np.ascontiguousarray(transform.layer_mask, dtype=np.bool_),
        }
        _check_arrays(arrays, identity, where="refusing to save an artifact")
        content: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "identity": identity.to_dict(),
            "dataset_hash": str(dataset_hash),
            "params": _plain(params),
            "metrics": _plain(metrics),
            "arrays": {
                n: {"dtype": str(a.dtype), "shape": list(a.shape)} for n, a in arrays.items()
            },
        }
        if token_predictor is not None:
            if token_predictor.shape != identity.shape:
                raise EldrError(
                    f"refusing to save an artifact: its token predictor is for"
                    f" {token_predictor.shape} experts, the model's are {identity.shape}"
                )
            content[PREDICTOR_KEY] = {
                "format": PREDICTOR_FORMAT,
                "tokens": len(token_predictor.token_ids),
                "rank": token_predictor.rank,
            }
            arrays.update({_PREDICTOR_PREFIX + n: a for n, a in token_predictor.arrays().items()})
        digest = _content_hash(content, arrays)
        version = digest[:12]
        target = self.root / version
        if not target.exists():
            manifest = {
                **content,
                "version": version,
                "content_sha256": digest,
                "provenance": _plain(provenance or {}),
            }
            self._write_version(target, manifest, arrays)
        if set_latest:
            self.set_latest(version)
        return version

    def set_latest(self, version: str) -> None:
        self._check_version_name(version)
        if not (self.root / version).is_dir():
            raise EldrError(f"artifact {version} not found in {self.root}")
        tmp = self.root / f".{LATEST}.{os.getpid()}.tmp"
        tmp.write_text(version + "\n")
        os.replace(tmp, self.root / LATEST)

    def _write_version(
        self, target: Path, manifest: dict[str, Any], arrays: dict[str, np.ndarray]
    ) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        try:
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            _write_npz(tmp / ARRAYS, arrays)
            try:
                os.rename(tmp, target)
            except OSError:
                # Someone saved the same content first; versions are immutable, keep theirs.
                if not target.is_dir():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)

    # -- reading -------------------------------------------------------------------------

    def latest_version(self) -> str | None:
        path = self.root / LATEST
        if not path.is_file():
            return None
        # Bytes, not text: a damaged pointer must read as a bad version name, not a decode error.
        version = path.read_bytes().decode("ascii", errors="replace").strip()
        self._check_version_name(version, what=f"{path} points to")
        return version

    def resolve(self, version: str = "latest") -> str:
        if version == "latest":
            found = self.latest_version()
            if found is None:
                raise EldrError(f"no artifact in {self.root}: run `eldr fit` first")
            return found
        self._check_version_name(version)
        return version

    def manifest(self, version: str = "latest") -> dict[str, Any]:
        """The stored manifest (for ``eldr artifacts show``)."""
        version = self.resolve(version)
        directory = self.root / version
        if not directory.is_dir():
            known = ", ".join(s.version for s in self.list()) or "none"
            raise EldrError(f"artifact {version} not found in {self.root} (available: {known})")
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise EldrError(
                f"artifact {version} is damaged: cannot read {MANIFEST}: {exc}"
            ) from exc
        if not isinstance(manifest, dict):
            raise EldrError(f"artifact {version} is damaged: {MANIFEST} is not an object")
        return manifest

    def load(self, version: str = "latest") -> Artifact:
        version = self.resolve(version)
        manifest = self.manifest(version)
        damaged = f"artifact {version} in {self.root} is damaged"
        try:
            identity = ModelIdentity.from_dict(manifest["identity"])
            content = {key: manifest[key] for key in _CONTENT_KEYS}
            if PREDICTOR_KEY in manifest:
                content[PREDICTOR_KEY] = manifest[PREDICTOR_KEY]
            provenance = manifest.get("provenance") or {}
            # Artifacts saved before versions were byte-for-byte the same stored the time.
            created = str(manifest.get("created") or self._saved_at(version))
        except (KeyError, TypeError) as exc:
            raise EldrError(f"{damaged}: manifest lacks {exc}") from exc
        except ValueError as exc:  # an identity that contradicts itself
            raise EldrError(f"{damaged}: {exc}") from exc
        if content["schema"] != SCHEMA_VERSION:
            raise EldrError(
                f"artifact {version} has schema {content['schema']}, this eldr reads "
                f"{SCHEMA_VERSION}; refit with `eldr fit`"
            )
        predictor_entry = content.get(PREDICTOR_KEY)
        if predictor_entry is not None and (
            not isinstance(predictor_entry, dict)
            or predictor_entry.get("format") != PREDICTOR_FORMAT
        ):
            raise EldrError(
                f"artifact {version} has a token predictor this eldr cannot read (format"
                f" {predictor_entry!r}, this eldr reads {PREDICTOR_FORMAT}); refit with"
                " `eldr fit`"
            )
        optional = (
            tuple(_PREDICTOR_PREFIX + n for n in PREDICTOR_ARRAYS) if predictor_entry else ()
        )
        arrays = self._read_arrays(version, damaged, optional)
        _check_arrays(arrays, identity, where=damaged)
        if _content_hash(content, arrays)[:12] != version:
            raise EldrError(f"{damaged}: its content no longer matches its version hash")
        try:
            transform = SignatureTransform(idf=arrays["idf"], layer_mask=arrays["layer_mask"])
        except ValueError as exc:
            raise EldrError(f"{damaged}: {exc}") from exc
        token_predictor = None
        if predictor_entry:
            try:
                token_predictor = TokenPredictor.from_arrays(
                    {n: arrays[_PREDICTOR_PREFIX + n] for n in PREDICTOR_ARRAYS},
                    identity.shape,
                )
            except ValueError as exc:
                raise EldrError(f"{damaged}: its token predictor: {exc}") from exc
        centroids = arrays["centroids"]
        centroids.setflags(write=False)
        return Artifact(
            version=version,
            centroids=centroids,
            transform=transform,
            identity=identity,
            dataset_hash=str(content["dataset_hash"]),
            params=content["params"],
            metrics=content["metrics"],
            created=created,
            provenance=provenance if isinstance(provenance, dict) else {},
            token_predictor=token_predictor,
        )

    def _saved_at(self, version: str) -> str:
        """When the version was saved: its directory's time (renamed into place then)."""
        stamp = (self.root / version).stat().st_mtime
        return datetime.fromtimestamp(stamp, timezone.utc).isoformat(timespec="seconds")

    def list(self) -> list[ArtifactSummary]:
        """All versions, newest first; unreadable ones are listed with their problem."""
        if not self.root.is_dir():
            return []
        latest = self.latest_version()
        out = []
        for directory in sorted(self.root.iterdir()):
            if not directory.is_dir() or not _VERSION_RE.match(directory.name):
                continue
            out.append(self._summary(directory.name, latest))
        return sorted(out, key=lambda s: (s.created, s.version), reverse=True)

    def _summary(self, version: str, latest: str | None) -> ArtifactSummary:
        # A full load, not just the manifest: damaged arrays or a content hash that no longer
        # matches are flagged here as ``show`` and ``serve`` would refuse them (artifacts are
        # K x D floats, so this stays cheap).
        try:
            artifact = self.load(version)
        except EldrError as exc:
            return ArtifactSummary(version, "", "?", 0, 0, "", version == latest, str(exc))
        return ArtifactSummary(
            version=version,
            created=artifact.created,
            model=artifact.identity.describe(),
            num_clusters=artifact.num_clusters,
            dim=artifact.dim,
            dataset_hash=artifact.dataset_hash,
            latest=version == latest,
        )

    def _read_arrays(
        self, version: str, damaged: str, optional: tuple[str, ...] = ()
    ) -> dict[str, np.ndarray]:
        """The required arrays and the ``optional`` ones the manifest declares."""
        path = self.root / version / ARRAYS
        try:
            with np.load(path, allow_pickle=False) as npz:
                missing = (set(_ARRAY_DTYPES) | set(optional)) - set(npz.files)
                if missing:
                    raise EldrError(f"{damaged}: {ARRAYS} lacks {sorted(missing)}")
                return {name: npz[name] for name in (*_ARRAY_DTYPES, *optional)}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise EldrError(f"{damaged}: cannot read {ARRAYS}: {exc}") from exc

    @staticmethod
    def _check_version_name(version: str, what: str = "version") -> None:
        if not _VERSION_RE.match(version):
            raise EldrError(f"{what} {version!r} is not an artifact version (12 hex digits)")


def _check_arrays(arrays: dict[str, np.ndarray], identity: ModelIdentity, where: str) -> None:
    for name, dtype in _ARRAY_DTYPES.items():
        if arrays[name].dtype != dtype:
            raise EldrError(f"{where}: {name} has dtype {arrays[name].dtype}, expected {dtype}")
    idf, mask, centroids = arrays["idf"], arrays["layer_mask"], arrays["centroids"]
    shape = (identity.num_layers, identity.num_experts)
    if idf.shape != shape:
        raise EldrError(f"{where}: idf has shape {idf.shape}, the model's is {shape}")
    if mask.shape != (identity.num_layers,):
        raise EldrError(f"{where}: layer_mask has shape {mask.shape}, expected ({shape[0]},)")
    dim = int(mask.sum()) * identity.num_experts
    if centroids.ndim != 2 or centroids.shape[0] < 1 or centroids.shape[1] != dim:
        raise EldrError(
            f"{where}: centroids have shape {centroids.shape}, expected [K, {dim}] "
            f"({int(mask.sum())} layers x {identity.num_experts} experts)"
        )
    if not np.isfinite(centroids).all() or not np.isfinite(idf).all():
        raise EldrError(f"{where}: centroids or idf contain NaN or infinity")


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez`` without its one varying byte: the zip entries' time (now, in savez)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            entry = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with archive.open(entry, "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, array, allow_pickle=False)


def _content_hash(content: dict[str, Any], arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256(_canonical_json(content))
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _plain(value: Any) -> Any:
    """JSON-ready copy: numpy scalars/arrays to Python, tuples to lists, NaN/inf to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"cannot store {type(value).__name__} in an artifact manifest")
