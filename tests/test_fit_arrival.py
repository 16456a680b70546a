"""The token predictor (a prompt's signature at arrival): its fit recovers a known per-token
routing, its prediction with and without a cached prefix, its place in the artifact (optional,
content-addressed), the prompt tokens a dataset's rows were prefilled with, and the share of
the after-prefill gain `eldr fit` says it keeps."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from eldr_cli.app import app
from stages import paths
from stages.errors import EldrError
from stages.fit.artifact import PREDICTOR_KEY, ArtifactStore
from stages.fit.prompt_tokens import PromptTokens, prompt_texts, prompt_tokens
from stages.fit.token_fit import fit_token_predictor
from stages.prompts import load_prompts
from stages.signature.dataset import (
    CaptureRecord,
    ModelIdentity,
    SignatureArrays,
    SignatureDataset,
    prompt_digest,
)
from stages.signature.token_predictor import TokenPredictor
from tests.test_fit_artifact import make_parts

VOCAB, LAYERS, EXPERTS, TOP_K = 120, 2, 8, 2


def token_routing(seed: int = 0) -> np.ndarray:
    """``[V, L, E]``: each token's top-k picks, one per expert picked."""
    rng = np.random.default_rng(seed)
    routing = np.zeros((VOCAB, LAYERS, EXPERTS))
    for token in range(VOCAB):
        for layer in range(LAYERS):
            routing[token, layer, rng.choice(EXPERTS, TOP_K, replace=False)] = 1
    return routing


def topical_prompts(n: int, seed: int) -> list[np.ndarray]:
    """Prompts drawn mostly from one of four topics' tokens, as real traffic's domains are."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        weights = np.ones(VOCAB)
        topic = rng.integers(4)
        weights[topic * 30:(topic + 1) * 30] = 8
        prompts.append(rng.choice(VOCAB, rng.integers(20, 60), p=weights / weights.sum()))
    return prompts


def test_fit_recovers_a_known_per_token_routing() -> None:
    routing = token_routing()
    train = topical_prompts(300, seed=1)
    fitted = fit_token_predictor(train, np.stack([routing[p].sum(axis=0) for p in train]))
    predictor = fitted.predictor
    assert predictor.shape == (LAYERS, EXPERTS) and fitted.loo_r2 > 0.99
    one_token = np.stack([predictor.predict_counts(np.array([t])) for t in range(VOCAB)])
    assert np.abs(one_token - routing).max() < 0.01
    # New prompts: near exact, where the mean token alone misses by a lot.
    held = topical_prompts(50, seed=2)
    truth = np.stack([routing[p].sum(axis=0) for p in held])
    predicted = np.stack([predictor.predict_counts(p) for p in held])
    mean_only = np.stack([len(p) * predictor.mean.reshape(LAYERS, EXPERTS) for p in held])
    assert np.abs(predicted - truth).sum() / truth.sum() < 0.01
    assert np.abs(mean_only - truth).sum() / truth.sum() > 0.2


def test_an_unseen_token_gets_the_mean_and_rank_truncates() -> None:
    routing = token_routing()
    train = [p[p < 100] for p in topical_prompts(200, seed=3)]  # tokens 100+ never seen
    counts = np.stack([routing[p].sum(axis=0) for p in train])
    predictor = fit_token_predictor(train, counts).predictor
    unseen = predictor.predict_counts(np.array([110, 119, 10_000]))
    assert np.allclose(unseen, 3 * predictor.mean.reshape(LAYERS, EXPERTS), atol=1e-6)
    # Per layer a token picks TOP_K experts: the mean token sums to TOP_K per layer.
    assert np.allclose(predictor.mean.reshape(LAYERS, EXPERTS).sum(axis=1), TOP_K, atol=1e-5)
    small = fit_token_predictor(train, counts, max_rank=3).predictor
    assert small.rank == 3 and small.factors.shape == (len(small.token_ids), 3)


def test_predict_signature_adds_the_cached_prefix_to_the_predicted_rest() -> None:
    routing = token_routing()
    train = topical_prompts(200, seed=4)
    predictor = fit_token_predictor(
        train, np.stack([routing[p].sum(axis=0) for p in train])).predictor
    prompt = topical_prompts(1, seed=5)[0]
    cached = routing[prompt[:16]].sum(axis=0)  # what the cached blocks' expert events say
    at_arrival = predictor.predict_signature(prompt, cached, 16)
    assert np.allclose(at_arrival, cached + predictor.predict_counts(prompt[16:]))
    assert np.allclose(predictor.predict_signature(prompt, None, 0),
                       predictor.predict_counts(prompt))
    # Whole prompt cached: the cached counts, exactly.
    assert np.array_equal(predictor.predict_signature(prompt, cached * 0 + 5, len(prompt)),
                          np.full((LAYERS, EXPERTS), 5.0))
    with pytest.raises(ValueError, match="cached tokens of a"):
        predictor.predict_signature(prompt, cached, len(prompt) + 1)
    with pytest.raises(ValueError, match="no cached counts"):
        predictor.predict_signature(prompt, None, 4)
    with pytest.raises(ValueError, match="cached counts"):
        predictor.predict_signature(prompt, np.zeros((3, EXPERTS)), 4)
    with pytest.raises(ValueError, match="non-negative"):
        predictor.predict_counts(np.array([3, -1]))


def small_predictor(identity: ModelIdentity) -> TokenPredictor:
    rng = np.random.default_rng(0)
    width = identity.num_layers * identity.num_experts
    return TokenPredictor(
        token_ids=np.array([1, 5, 9], np.int32), factors=rng.random((3, 2), np.float32),
        basis=rng.random((2, width), np.float32),
        mean=np.full(width, 0.25, np.float32), shape=identity.shape,
    )


# make_parts() saved by the artifact store as it was before the token predictor: the same
# version, and the same arrays.npz bytes, from the store now.
BEFORE_PREDICTOR = ("1b304c599100",
                    "611421bfabdfdd5b9a85e8e78a66264abc6c04a61454dee069161cb42f3b052a")


def test_an_artifact_without_a_predictor_is_the_bytes_it_was(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    version = store.save(**make_parts())
    arrays = hashlib.sha256((tmp_path / version / "arrays.npz").read_bytes()).hexdigest()
    assert (version, arrays) == BEFORE_PREDICTOR
    loaded = store.load(version)
    assert loaded.token_predictor is None
    assert PREDICTOR_KEY not in json.loads((tmp_path / version / "manifest.json").read_text())


def test_the_predictor_round_trips_and_is_content_addressed(tmp_path: Path) -> None:
    parts = make_parts()
    predictor = small_predictor(parts["identity"])
    store = ArtifactStore(tmp_path / "a")
    version = store.save(**parts, token_predictor=predictor)
    assert version != BEFORE_PREDICTOR[0]
    loaded = store.load(version).token_predictor
    assert loaded is not None
    for name, array in predictor.arrays().items():
        assert np.array_equal(loaded.arrays()[name], array)
    tokens = np.array([1, 1, 9, 4])
    assert np.array_equal(loaded.predict_counts(tokens), predictor.predict_counts(tokens))
    # Same inputs, same bytes, in another store too.
    other = ArtifactStore(tmp_path / "b")
    assert other.save(**parts, token_predictor=predictor) == version
    for name in ("manifest.json", "arrays.npz"):
        assert ((tmp_path / "a" / version / name).read_bytes()
                == (tmp_path / "b" / version / name).read_bytes())


def test_a_predictor_of_an_unknown_format_or_dropped_entry_is_refused(tmp_path: Path) -> None:
    parts = make_parts()
    store = ArtifactStore(tmp_path)
    version = store.save(**parts, token_predictor=small_predictor(parts["identity"]))
    manifest_path = tmp_path / version / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest[PREDICTOR_KEY]["format"] = 99
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(EldrError, match="token predictor this eldr cannot read"):
        store.load(version)
    del manifest[PREDICTOR_KEY]  # the hash covers the entry: dropping it is damage
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(EldrError, match="no longer matches its version hash"):
        store.load(version)


def test_a_predictor_of_another_shape_is_not_saved(tmp_path: Path) -> None:
    parts = make_parts()
    other = ModelIdentity(name="x", num_layers=2, num_experts=8, top_k=2)
    with pytest.raises(EldrError, match="token predictor is for"):
        ArtifactStore(tmp_path).save(**parts, token_predictor=small_predictor(other))


def rows(ids: list[str], digests: list[str], lengths: list[int]) -> SignatureArrays:
    n = len(ids)
    zeros = np.zeros((n, 1, 2), np.int32)
    return SignatureArrays(
        ids=np.array(ids, dtype=object), domains=np.array(["d"] * n, dtype=object),
        prompt_sha256=np.array(digests, dtype=object), prompt_tokens=np.array(lengths),
        output_tokens=np.zeros(n, np.int32), prefill_counts=zeros, decode_counts=zeros,
    )


def test_prompt_tokens_come_from_the_record_or_the_prompt_file_of_the_same_digest() -> None:
    first = load_prompts(paths.CALIBRATION_PROMPTS)[0]
    arrays = rows(["live-1", first.id, first.id],
                  [prompt_digest("a b c d"), prompt_digest(first.prompt), prompt_digest("x")],
                  [3, 2, 1])
    texts = prompt_texts(arrays, np.array(["a b c d", "", ""], dtype=object))
    assert texts == ["a b c d", first.prompt, None]  # the third's file text is another's
    missing = prompt_tokens(arrays, texts, load_encoder=lambda: pytest.fail("not needed"))
    assert missing.tokens is None and missing.missing.startswith("1 of 3 requests have no")

    def encode(text: str) -> list[int]:
        return [len(word) for word in text.split()]

    known = rows(["live-1"], [prompt_digest("a bb ccc dddd")], [3])
    texts = prompt_texts(known, np.array(["a bb ccc dddd"], dtype=object))
    found = prompt_tokens(known, texts, lambda: encode)
    # The last tokens, as `eldr capture` cuts a prompt.
    assert found.tokens is not None and found.tokens[0].tolist() == [2, 3, 4]
    longer = rows(["live-1"], [prompt_digest("a bb")], [3])
    refused = prompt_tokens(longer, ["a bb"], lambda: encode)
    assert refused.tokens is None and "not the tokenizer the capture ran with" in refused.missing

    def no_tokenizer() -> list[int]:
        raise EldrError("cannot load the tokenizer of x")

    assert prompt_tokens(known, texts, no_tokenizer) == PromptTokens(
        None, "cannot load the tokenizer of x")


def calibration_dataset(path: Path, n: int) -> Path:
    """The bundled calibration prompts with counts from a known per-token routing of the tiny
    model's tokenizer, and decode counts that follow the prompt's domain (so prefill routing
    gains), as `eldr capture` would store them."""
    from transformers import AutoTokenizer

    experts = 24  # a pair per domain (7), the rest for tokens every domain uses
    identity = ModelIdentity(name="tiny", num_layers=LAYERS, num_experts=experts, top_k=TOP_K)
    tokenizer = AutoTokenizer.from_pretrained(paths.BUNDLED_MODELS_DIR / "tiny")
    rng = np.random.default_rng(0)
    prompts = load_prompts(paths.CALIBRATION_PROMPTS)[:n]
    encoded = [tokenizer.encode(prompt.prompt) for prompt in prompts]
    domains = sorted({prompt.domain for prompt in prompts})
    usage = np.zeros((len(tokenizer), len(domains)))
    for prompt, ids in zip(prompts, encoded, strict=True):
        np.add.at(usage[:, domains.index(prompt.domain)], ids, 1)
    # A token most of whose uses are one domain's routes to that domain's pair; any other to
    # a random generic pair. Decode uses the domain's pair: prefill routing predicts it.
    share = usage.max(axis=1) / np.maximum(usage.sum(axis=1), 1)
    generic = 2 * len(domains) + 2 * rng.integers(0, (experts - 2 * len(domains)) // 2,
                                                  len(tokenizer))
    pair = np.where(share > 0.8, 2 * usage.argmax(axis=1), generic)
    routing = np.zeros((len(tokenizer), LAYERS, experts), np.int32)
    routing[np.arange(len(tokenizer)), :, pair] = 1
    routing[np.arange(len(tokenizer)), :, pair + 1] = 1
    records = []
    for prompt, ids in zip(prompts, encoded, strict=True):
        prefill = routing[ids].sum(axis=0)
        decode = rng.poisson(0.3, (LAYERS, experts)).astype(np.int32)
        home = 2 * domains.index(prompt.domain)
        decode[:, home:home + 2] += rng.poisson(12, (LAYERS, 2)).astype(np.int32)
        records.append(CaptureRecord(
            id=prompt.id, domain=prompt.domain, prompt_sha256=prompt_digest(prompt.prompt),
            prompt_tokens=len(ids), output_tokens=16, prefill_counts=prefill,
            decode_counts=decode,
        ))
    dataset = SignatureDataset.create_or_open(path, identity, vllm_version="test")
    dataset.append(records)
    return path


def test_fit_prints_the_gain_kept_at_arrival_and_stores_the_predictor(tmp_path: Path) -> None:
    data = calibration_dataset(tmp_path / "sig.zarr", n=400)
    store = tmp_path / "artifacts"
    result = CliRunner().invoke(app, [
        "fit", "--k", "7", "--data", str(data), "--store", str(store), "--no-plot",
        "--no-dial", "--decode-batch", "4,8",
    ])
    assert result.exit_code == 0, result.output
    out = result.output.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("signature at arrival ("))
    assert "cross-fitted, the predictor fit without the request" in out[head]
    assert out[head + 1].split() == ["batch", "after", "prefill", "arrival,", "nothing",
                                     "cached", "kept"]
    table = [out[head + 2].split(), out[head + 3].split()]
    assert [row[0] for row in table] == ["4", "8"]
    for row in table:
        after, arrival, kept = float(row[1][:-1]), float(row[2][:-1]), float(row[3][:-1])
        # The counts are exactly per-token: the predictor keeps nearly all of the gain.
        assert after < -1 and arrival < 0 and 90 <= kept <= 110
    assert "with a cached prefix: not measured (no captured prompt extends another" in out[head + 4]
    artifact = ArtifactStore(store).load()
    assert artifact.token_predictor is not None
    assert artifact.metrics["expected_gain"]["arrival"]["predictor"]["loo_r2"] > 0.99
    shown = CliRunner().invoke(app, ["artifacts", "show", "--gain", "--store", str(store)])
    assert "signature at arrival (" in shown.output


def test_fit_says_why_it_has_no_arrival_figure(tmp_path: Path) -> None:
    from tests.test_fit_cli import write_dataset
    from tests.test_fit_gain import domain_counts

    prefill, decode = domain_counts(seed=0, n=200)
    data = write_dataset(tmp_path / "sig.zarr", prefill, decode)
    result = CliRunner().invoke(app, [
        "fit", "--k", "2", "--data", str(data), "--store", str(tmp_path / "a"), "--no-plot",
        "--no-dial", "--decode-batch", "4",
    ])
    assert result.exit_code == 0, result.output
    assert ("signature at arrival: not measured: 200 of 200 requests have no prompt text"
            in result.output)
    assert ArtifactStore(tmp_path / "a").load().token_predictor is None


def test_a_wide_fit_factors_its_offsets_without_forming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The randomized SVD (wide models) finds the exact SVD's top factors."""
    from stages.fit import token_fit

    routing = token_routing()
    train = topical_prompts(200, seed=6)
    counts = np.stack([routing[p].sum(axis=0) for p in train])
    exact = fit_token_predictor(train, counts, max_rank=6).predictor
    monkeypatch.setattr(token_fit, "_EXACT_SVD_ENTRIES", 0)
    sketched = fit_token_predictor(train, counts, max_rank=6).predictor
    for prompt in topical_prompts(20, seed=7):
        assert np.allclose(sketched.predict_counts(prompt), exact.predict_counts(prompt),
                           atol=1e-3 * len(prompt))
