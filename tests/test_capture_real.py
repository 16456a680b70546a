"""Signature capture against real vLLM on the bundled tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from stages.signature import wire
from stages.signature.dataset import SignatureDataset
from tests.conftest import TINY, requires_vllm, without_probe

pytestmark = [requires_vllm, pytest.mark.vllm]

PROMPTS = [
    {"id": "code-1", "domain": "code",
     "prompt": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
               "        a, b = b, a + b\n    return a\n\n"
               "class Stack:\n    def __init__(self):\n        self.items = []\n"},
    {"id": "math-1", "domain": "math",
     "prompt": "Solve: A farmer has 17 sheep and buys 5 more each week. How many sheep does he"
               " have after 6 weeks? Explain each step."},
    {"id": "fr-1", "domain": "prose-fr",
     "prompt": "Continuez ce texte : Le matin, la ville se réveille lentement. Les boulangers"
               " ouvrent leurs portes et les enfants partent pour l'école."},
    {"id": "rec-1", "domain": "records",
     "prompt": 'Continue the records: {"id": 1, "name": "Alice", "age": 31, "city": "Lyon"}\n'
               '{"id": 2, "name": "Bob", "age": 45, "city": "Oslo"}\n'},
]
MAX_TOKENS = 6


def _all_prompts() -> list[dict[str, str]]:
    """The hand-written prompts plus a spread of bundled evaluation prompts (~4k tokens)."""
    from stages.paths import EVALUATION_PROMPTS

    lines = EVALUATION_PROMPTS.read_text().splitlines()
    return PROMPTS + [json.loads(line) for line in lines[::60][:12]]


# Eager mode, and vLLM's default compiled mode over two tensor-parallel ranks (on CPU a core
# each; scripts/gpu-check.sh runs it on two GPUs where there are two). Compiled on one rank is
# what the suite's calibration capture and the card's deployment run; a capture of its own here
# would check nothing these two do not.
MODES = {
    "eager": ["--enforce-eager"],
    "compiled-tp2": ["--compiled", "--tensor-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def capture_in(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Callable[[str], tuple[Path, Path]]:
    """`eldr capture` through the real CLI, one prompt per batch, with per-token tracing, in
    one of MODES; each mode runs once per module, whichever tests ask for it."""
    runs: dict[str, tuple[Path, Path]] = {}

    def run(mode: str) -> tuple[Path, Path]:
        if mode in runs:
            return runs[mode]
        work = tmp_path_factory.mktemp(f"capture-{mode}")
        prompts = work / "prompts.jsonl"
        prompts.write_text("\n".join(json.dumps(p) for p in _all_prompts()) + "\n")
        out = work / "sig.zarr"
        trace = work / "trace"
        env = {**os.environ, "ELDR_TRACE_DIR": str(trace)}
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # eldr binds a core per TP rank itself
        cmd = [sys.executable, "-m", "eldr_cli", "capture", "--model", "tiny", "--prompts",
               str(prompts), "--out", str(out), "--max-tokens", str(MAX_TOKENS),
               "--batch-size", "1", *MODES[mode]]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[mode] = (out, trace)
        return runs[mode]

    return run


@pytest.fixture(params=list(MODES))
def captured(request: pytest.FixtureRequest, capture_in: Callable[[str], tuple[Path, Path]]
             ) -> tuple[Path, Path]:
    return capture_in(request.param)


def prompt_picks(captured: tuple[Path, Path]) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """Each prompt token's traced expert ids ``[L, prompt tokens, k]`` (decode tokens left
    out), and ``(id, prompt tokens)`` per request in dataset order."""
    steps = sorted(captured[1].glob("step-*.npy"))
    traced = without_probe(np.concatenate([np.load(s) for s in steps], axis=1), TINY)
    arrays = SignatureDataset.open(captured[0]).read()
    offset, parts, requests = 0, [], []
    for req_id, n_prompt, n_out in zip(arrays.ids, arrays.prompt_tokens, arrays.output_tokens,
                                       strict=True):
        parts.append(traced[:, offset : offset + n_prompt])
        requests.append((str(req_id), int(n_prompt)))
        offset += n_prompt + n_out - 1
    assert offset == traced.shape[1]
    return np.concatenate(parts, axis=1), requests


def test_capture_stores_every_prompt_with_exact_row_sums(captured: tuple[Path, Path]) -> None:
    dataset = SignatureDataset.open(captured[0])
    arrays = dataset.read()
    top_k = dataset.identity.top_k
    assert sorted(arrays.ids.tolist()) == sorted(p["id"] for p in _all_prompts())
    assert (arrays.output_tokens == MAX_TOKENS).all()
    # Every prompt token picks top_k experts in every layer; decode counts cover the generated
    # tokens fed back into the model (all but the last).
    np.testing.assert_array_equal(
        arrays.prefill_counts.sum(axis=2), np.outer(arrays.prompt_tokens, np.ones(4)) * top_k
    )
    np.testing.assert_array_equal(
        arrays.decode_counts.sum(axis=2), np.full((len(arrays), 4), (MAX_TOKENS - 1) * top_k)
    )


def test_capture_rerun_skips_stored_prompts(captured: tuple[Path, Path]) -> None:
    before = SignatureDataset.open(captured[0]).content_hash()
    prompts = captured[0].parent / "prompts.jsonl"
    cmd = [sys.executable, "-m", "eldr_cli", "capture", "--model", "tiny", "--prompts",
           str(prompts), "--out", str(captured[0]), "--max-tokens", str(MAX_TOKENS)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"0 new signatures ({len(_all_prompts())} already there)" in result.stdout
    assert SignatureDataset.open(captured[0]).content_hash() == before


def test_recorded_expert_ids_match_transformers_router(
    captured: tuple[Path, Path], tiny_model: Path
) -> None:
    """Per-token top-k from the plugin vs Hugging Face's router on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    picks, requests = prompt_picks(captured)
    texts = {p["id"]: p["prompt"] for p in _all_prompts()}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    offset = 0
    agree = np.zeros(4)
    clear_agree = np.zeros(4)
    clear_total = np.zeros(4)
    for req_id, n_prompt in requests:
        ids = tokenizer(texts[req_id])["input_ids"][-(1024 - MAX_TOKENS):]
        assert len(ids) == n_prompt
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_router_logits=True)
        logits = torch.stack([layer.float() for layer in out.router_logits]).numpy()  # [L,T,E]
        hf = np.argsort(-logits, axis=-1)[..., :2]
        probs = torch.softmax(torch.from_numpy(logits), dim=-1).numpy()
        ranked = np.sort(probs, axis=-1)
        # vLLM computes in bf16, transformers here in fp32: a token whose 2nd and 3rd experts
        # are within 0.01 probability is a near-tie either may break differently.
        clear = ranked[..., -2] - ranked[..., -3] > 0.01
        ours = picks[:, offset : offset + n_prompt]
        same = (np.sort(ours, -1) == np.sort(hf, -1)).all(-1)
        agree += same.sum(-1)
        clear_agree += (same & clear).sum(-1)
        clear_total += clear.sum(-1)
        offset += n_prompt
    total = offset
    assert total > 2000
    assert (agree / total >= 0.98).all(), f"per-layer agreement {agree / total}"
    clear_rate = clear_agree / clear_total
    assert (clear_rate >= 0.995).all(), f"without near-ties {clear_rate}"


def test_tensor_parallel_capture_equals_single_rank(
    capture_in: Callable[[str], tuple[Path, Path]]
) -> None:
    """TP=2 (compiled) records what TP=1 (eager) records: the same tokens, each filed once (one
    rank records). The two engines' bf16 sums run in a different order, so a near-tie token
    may pick another expert: measured 0.17% of picks between compiled TP=1 and TP=2, and up to
    1.05% in one layer between eager TP=1 and compiled TP=2 where the engines batched the
    prompts differently (a CI run beside the fast suite). A rank's picks lost or filed twice
    would cost half of them or more."""
    one, two = capture_in("eager"), capture_in("compiled-tp2")
    picks_one, requests_one = prompt_picks(one)
    picks_two, requests_two = prompt_picks(two)
    assert requests_one == requests_two
    same = (np.sort(picks_one, -1) == np.sort(picks_two, -1)).all(-1)  # [L, tokens]
    assert (same.mean(1) >= 0.98).all(), f"per-layer token agreement {same.mean(1)}"
    a = SignatureDataset.open(one[0]).read()
    b = SignatureDataset.open(two[0]).read()
    assert a.ids.tolist() == b.ids.tolist()
    # Every token counted once, in every layer, by exactly one rank.
    np.testing.assert_array_equal(b.prefill_counts.sum(2), a.prefill_counts.sum(2))
    moved = np.abs(a.prefill_counts.astype(int) - b.prefill_counts).sum() / 2
    assert moved / a.prefill_counts.sum() < 0.01


def test_prefix_cache_hit_signature_equals_cold_run(plain_server: str) -> None:
    base = "def parse(line):\n    key, _, value = line.partition('=')\n    return key, value\n" * 6
    longer = base + "\ndef main():\n    print(parse('a=1'))\n"

    def signature(prompt: str) -> tuple[np.ndarray, int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        response = httpx.post(f"{plain_server}/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        payload = response.json()
        counts = wire.decode(payload["kv_transfer_params"])
        assert counts is not None
        cached = (payload.get("usage") or {}).get("prompt_tokens_details") or {}
        return counts, int(cached.get("cached_tokens") or 0)

    httpx.post(f"{plain_server}/reset_prefix_cache", timeout=30).raise_for_status()
    cold_long, _ = signature(longer)
    httpx.post(f"{plain_server}/reset_prefix_cache", timeout=30).raise_for_status()
    cold_base, _ = signature(base)
    warm_long, hit_long = signature(longer)  # reuses the blocks `base` filled
    warm_base, hit_base = signature(base)  # a full prefix hit
    assert hit_long > 0 and hit_base > 0
    np.testing.assert_array_equal(warm_long, cold_long)
    np.testing.assert_array_equal(warm_base, cold_base)
