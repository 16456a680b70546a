"""Artifact store: round trip, content addressing, latest pointer, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stages.errors import EldrError
from stages.fit.artifact import ArtifactStore, check_identity
from stages.signature.dataset import ModelIdentity
from stages.signature.transform import SignatureTransform

IDENTITY = ModelIdentity(name="tiny-moe", num_layers=4, num_experts=8, top_k=2)


def make_parts(seed: int = 0, k: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    mask = np.array([True, False, True, True])
    transform = SignatureTransform(idf=rng.random((4, 8)).astype(np.float32), layer_mask=mask)
    centroids = rng.standard_normal((k, transform.dim)).astype(np.float32)
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return {
        "centroids": centroids,
        "transform": transform,
        "identity": IDENTITY,
        "dataset_hash": "ab" * 32,
        "params": {"k": k, "seed": seed, "balanced": True},
        "metrics": {"cluster_sizes": np.array([4, 4, 3]), "rho_trace": [0.5, np.float64(0.6)]},
    }


def test_round_trip(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    parts = make_parts()
    version = store.save(**parts)
    assert len(version) == 12 and int(version, 16) >= 0
    loaded = store.load()  # latest
    assert loaded.version == version
    assert np.array_equal(loaded.centroids, parts["centroids"])
    assert loaded.centroids.dtype == np.float32
    assert np.array_equal(loaded.transform.idf, parts["transform"].idf)
    assert np.array_equal(loaded.transform.layer_mask, parts["transform"].layer_mask)
    assert loaded.identity == IDENTITY
    assert loaded.dataset_hash == parts["dataset_hash"]
    assert loaded.params == {"k": 3, "seed": 0, "balanced": True}
    assert loaded.metrics == {"cluster_sizes": [4, 4, 3], "rho_trace": [0.5, 0.6]}
    assert loaded.created
    counts = np.arange(32).reshape(4, 8)
    assert np.array_equal(loaded.transform.apply(counts), parts["transform"].apply(counts))
    # Content-addressed: the same fit is the same version; a different one is not.
    assert store.save(**parts) == version
    assert store.save(**make_parts(seed=1)) != version
    assert (tmp_path / "store" / version / "manifest.json").is_file()


def test_latest_pointer_and_list(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    first = store.save(**make_parts(seed=0))
    second = store.save(**make_parts(seed=1))
    assert (tmp_path / "latest").read_text().strip() == second
    assert store.load().version == second
    assert store.load(first).version == first
    store.set_latest(first)
    assert store.load("latest").version == first
    listed = {s.version: s for s in store.list()}
    assert set(listed) == {first, second}
    assert listed[first].latest and not listed[second].latest
    assert listed[first].num_clusters == 3 and listed[first].dim == 24
    assert "tiny-moe" in listed[first].describe() and listed[first].describe().startswith("*")
    # save(set_latest=False) leaves the pointer alone.
    third = store.save(**make_parts(seed=2), set_latest=False)
    assert store.load().version == first and store.load(third).version == third


def test_identity_mismatch_is_refused(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    store.save(**make_parts())
    artifact = store.load()
    check_identity(artifact, IDENTITY)
    other = ModelIdentity(name="Qwen3-30B-A3B", num_layers=48, num_experts=128, top_k=8)
    with pytest.raises(EldrError, match=r"tiny-moe.*Qwen3-30B-A3B"):
        check_identity(artifact, other)
    same_shape = ModelIdentity(name="other-moe", num_layers=4, num_experts=8, top_k=2)
    with pytest.raises(EldrError, match="other-moe"):
        check_identity(artifact, same_shape)


def test_missing_store_and_unknown_version(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "none")
    with pytest.raises(EldrError, match="no artifact"):
        store.load()
    assert store.list() == []
    store.save(**make_parts())
    with pytest.raises(EldrError, match="not found"):
        store.load("0123456789ab")
    with pytest.raises(EldrError, match="not an artifact version"):
        store.load("../../etc")


def test_damaged_artifacts_are_refused(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    version = store.save(**make_parts())
    directory = tmp_path / version

    # Arrays changed behind the store's back (a valid npz, wrong content).
    arrays = dict(np.load(directory / "arrays.npz"))
    arrays["centroids"] = arrays["centroids"][::-1].copy()
    np.savez(directory / "arrays.npz", **arrays)
    with pytest.raises(EldrError, match=r"damaged.*version hash"):
        store.load(version)
    # `eldr artifacts list` flags what `show` and `serve` would refuse.
    [summary] = store.list()
    assert "DAMAGED" in summary.describe() and "version hash" in summary.describe()

    # Wrong shapes.
    arrays["centroids"] = arrays["centroids"][:, :5]
    np.savez(directory / "arrays.npz", **arrays)
    with pytest.raises(EldrError, match="centroids have shape"):
        store.load(version)

    # An object array would need unpickling: refused, never executed.
    arrays["centroids"] = np.array([{"evil": 1}], dtype=object)
    np.savez(directory / "arrays.npz", **arrays)
    with pytest.raises(EldrError, match="damaged"):
        store.load(version)

    # Truncated file.
    (directory / "arrays.npz").write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(EldrError, match=r"cannot read arrays\.npz"):
        store.load(version)

    # Garbage manifest: load refuses, list reports it instead of failing.
    (directory / "manifest.json").write_text("{not json")
    with pytest.raises(EldrError, match=r"cannot read manifest\.json"):
        store.load(version)
    [summary] = store.list()
    assert summary.problem and "DAMAGED" in summary.describe()


def test_manifest_tampering_is_detected(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    version = store.save(**make_parts())
    path = tmp_path / version / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["identity"]["name"] = "someone-else"
    path.write_text(json.dumps(manifest))
    with pytest.raises(EldrError, match="version hash"):
        store.load(version)
    manifest["identity"]["num_layers"] = 5
    path.write_text(json.dumps(manifest))
    with pytest.raises(EldrError, match="4 MoE layer indices for L=5"):
        store.load(version)
    manifest["identity"]["moe_layers"] = [0, 1, 2, 3, 4]
    path.write_text(json.dumps(manifest))
    with pytest.raises(EldrError, match="idf has shape"):
        store.load(version)


def test_save_refuses_inconsistent_parts(tmp_path: Path) -> None:
    parts = make_parts()
    parts["centroids"] = parts["centroids"][:, :7]
    with pytest.raises(EldrError, match="centroids have shape"):
        ArtifactStore(tmp_path).save(**parts)
    assert not any(tmp_path.iterdir())


def test_serving_takes_any_k_of_at_least_the_decode_worker_count(tmp_path: Path) -> None:
    from stages.fit.artifact import load_for_serving

    store = ArtifactStore(tmp_path / "store")
    store.save(**make_parts(k=3))
    for workers in (1, 2, 3):  # K=3 spread over 1-3 workers (cluster_map)
        assert load_for_serving(store.root, "latest", IDENTITY, workers).centroids.shape[0] == 3
    with pytest.raises(EldrError, match="3 centroids for 4 decode workers") as refused:
        load_for_serving(store.root, "latest", IDENTITY, 4)
    assert "eldr fit --k 4 --balanced" in str(refused.value)


def test_the_same_fit_into_two_stores_is_the_same_version_byte_for_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Content-addressed: the command line (the store's path in it) and the time of the fit
    are not content; the version, the manifest, the arrays and fit.png come out the same."""
    from typer.testing import CliRunner

    from eldr_cli.app import app
    from tests.test_fit_cli import write_dataset
    from tests.test_fit_gain import domain_counts

    data = write_dataset(tmp_path / "sig.zarr", *domain_counts(seed=0))
    stores = [tmp_path / "first", tmp_path / "second"]
    for store in stores:
        args = ["fit", "--k", "4", "--data", str(data), "--store", str(store), "--no-dial"]
        monkeypatch.setattr("sys.argv", ["eldr", *args])  # what provenance reads
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    files = [{p.relative_to(s): p.read_bytes() for p in sorted(s.rglob("*")) if p.is_file()}
             for s in stores]
    assert files[0].keys() == files[1].keys()
    assert any(p.name == "fit.png" for p in files[0])
    for name, content in files[0].items():
        assert files[1][name] == content, f"{name} differs between the two stores"
    manifest = json.loads(next(c for p, c in files[0].items() if p.name == "manifest.json"))
    assert str(stores[0]) not in json.dumps(manifest)
    assert manifest["provenance"]["command"].startswith("eldr fit --k 4 --data")
    assert ArtifactStore(stores[0]).load().created  # from the store, not from the bytes
