"""Capture every tiny MoE family through eldr's real capture path in one vLLM mode.

Run by ``test_architectures_real.py`` as ``python -m tests.arch_capture MODE ROOT [FAMILY...]``
(default: every family): one engine
at a time (in this process or its own, as ``VLLM_ENABLE_V1_MULTIPROCESSING`` says), per-step
expert ids traced to ``ROOT/<family>/trace``.
A family that fails is recorded in ``ROOT/results.json`` with its error, and the next one runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from stages.errors import EldrError
from stages.paths import EVALUATION_PROMPTS
from stages.prompts import Prompt, load_prompts
from tests.moe_families import FAMILIES, build_model

MAX_TOKENS = 4
NUM_PROMPTS = 6


def family_prompts() -> list[Prompt]:
    """A spread of bundled evaluation prompts (several domains), cut to keep the run short."""
    prompts = load_prompts(EVALUATION_PROMPTS)[::97][:NUM_PROMPTS]
    return [Prompt(id=p.id, prompt=p.prompt[:400], domain=p.domain) for p in prompts]


def main(mode: str, root: Path, names: list[str]) -> None:
    from stages.capture.runner import CaptureConfig, EngineProbe, capture
    from stages.models import resolve_model
    from stages.serve.proxy.ops.self_check import PROBE_PROMPT, check_signature

    config = CaptureConfig(max_tokens=MAX_TOKENS, batch_size=1, max_num_seqs=4,
                           enforce_eager=mode == "eager")
    results: dict[str, dict[str, object]] = {}
    for family in (f for f in FAMILIES if not names or f.name in names):
        work = root / family.name
        model_dir = build_model(family, work / "model")
        os.environ["ELDR_TRACE_DIR"] = str(work / "trace")
        started = time.perf_counter()
        try:
            capture(resolve_model(str(model_dir)), family_prompts(), work / "sig.zarr", config,
                    EngineProbe(PROBE_PROMPT, check_signature))
            results[family.name] = {"ok": True}
        except EldrError as exc:  # recorded for the test to report, not hidden
            results[family.name] = {"ok": False, "error": str(exc)}
        results[family.name]["seconds"] = round(time.perf_counter() - started, 1)
        print(family.name, results[family.name], flush=True)
        (root / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
