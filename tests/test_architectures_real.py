"""Every MoE family vLLM's CPU build runs, captured by eldr in vLLM's default (compiled) mode,
agrees with the experts the Hugging Face model dispatches each token to.

Mixtral, the bundled model's family, is checked against Hugging Face by
``test_capture_real.py`` in compiled and eager mode and over two tensor-parallel ranks, so it
is not captured again here; eager mode runs the same recording module without the compiled
graph, so one family in eager mode stands for the rest. The families are captured by two
processes at once, each on its own core, and each engine runs inside its capture process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): what is checked here is each model's routing record,
which does not depend on where the engine core runs, while vLLM's own process layout (engine
core and workers in processes of their own) is what every test of the bundled model runs.
In-process, an engine after the first starts without importing vLLM again: 12-30 s a family
against 36-56 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stages.signature.dataset import SignatureDataset
from tests.arch_capture import MAX_TOKENS, family_prompts
from tests.conftest import requires_vllm, without_probe
from tests.moe_families import FAMILIES, Family, hf_routing

pytestmark = [requires_vllm, pytest.mark.vllm]


CAPTURED = tuple(f for f in FAMILIES if f.name != "mixtral")


def capture_families(root: Path, families: tuple[Family, ...]) -> Path:
    """Capture ``families`` in compiled mode into ``root/<family>``, split over up to two
    processes pinned to a core each."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    groups = [families[i :: len(cores)] for i in range(len(cores))]
    runs = []
    for core, group in zip(cores, groups, strict=True):
        out = root / f"group-{core}"
        out.mkdir(parents=True)
        cmd = [sys.executable, "-m", "tests.arch_capture", "compiled", str(out),
               *(f.name for f in group)]
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        with (out / "log").open("w") as log:  # a file, not a pipe: nothing blocks on it
            runs.append((out, subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=lambda core=core: os.sched_setaffinity(0, {core}),
            )))
    for out, run in runs:
        run.wait(timeout=1500)
        assert run.returncode == 0, (out / "log").read_text()[-3000:]
    return root


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return capture_families(tmp_path_factory.mktemp("families-compiled"), CAPTURED)


@pytest.mark.parametrize("family", CAPTURED, ids=lambda f: f.name)
def test_compiled_capture_agrees_with_hugging_face_router(compiled: Path, family: Family) -> None:
    [results] = [p for p in compiled.glob("group-*/results.json")
                 if family.name in json.loads(p.read_text())]
    check_agreement(results.parent, family)


def check_agreement(captured: Path, family: Family) -> None:
    from transformers import AutoTokenizer

    outcome = json.loads((captured / "results.json").read_text())[family.name]
    assert outcome["ok"], outcome.get("error")
    work = captured / family.name
    dataset = SignatureDataset.open(work / "sig.zarr")
    # The identity records the MoE layers as vLLM built them (dense layers left out).
    assert dataset.identity.moe_layers == family.moe_layers
    assert dataset.identity.shape == (len(family.moe_layers), family.num_experts)
    arrays = dataset.read()
    steps = sorted((work / "trace").glob("step-*.npy"))
    traced = without_probe(np.concatenate([np.load(s) for s in steps], axis=1), work / "model")
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    texts = {p.id: p.prompt for p in family_prompts()}
    agree = clear_agree = clear_total = total = 0
    offset = 0
    for req_id, n_prompt, n_out, counts in zip(
        arrays.ids, arrays.prompt_tokens, arrays.output_tokens, arrays.prefill_counts,
        strict=True,
    ):
        ids = tokenizer(texts[str(req_id)])["input_ids"]
        assert len(ids) == n_prompt
        np.testing.assert_array_equal(counts.sum(axis=1), n_prompt * family.top_k)
        hf = hf_routing(work / "model", ids)
        ours = np.sort(traced[:, offset : offset + n_prompt], axis=-1)
        same = (ours == hf.experts).all(axis=-1)  # [L, tokens]
        agree += int(same.sum())
        clear_agree += int((same & ~hf.near_tie).sum())
        clear_total += int((~hf.near_tie).sum())
        total += same.size
        offset += n_prompt + n_out - 1
    assert offset == traced.shape[1]
    assert len(arrays) == len(family_prompts()) and (arrays.output_tokens == MAX_TOKENS).all()
    assert agree / total >= 0.98, f"agreement {agree / total:.4f} over {total} token-layers"
    # bf16 (vLLM) and fp32 (reference) may break near ties differently; nothing else may differ.
    assert clear_agree / clear_total >= 0.995, f"without near-ties {clear_agree / clear_total}"
