"""One vLLM engine with eldr's connector in a given parallel layout: its prompts' signatures.

Run by ``test_parallel_layouts_real.py`` as ``python -m tests.layout_capture KWARGS_JSON OUT``:
builds ``vllm.LLM`` on the bundled tiny model with the JSON engine arguments (e.g.
``{"pipeline_parallel_size": 2}``), captures a spread of evaluation prompts and saves each
prompt's signature and the MoE layers the engine reported to ``OUT`` (npz). A refused layout
ends the process with vLLM's error, which the test reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main(kwargs: dict[str, object], out: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from stages.engine import kv_transfer_config
    from stages.paths import BUNDLED_MODELS_DIR, EVALUATION_PROMPTS
    from stages.prompts import load_prompts
    from stages.signature import wire

    engine = LLM(model=str(BUNDLED_MODELS_DIR / "tiny"), max_model_len=1024, seed=0,
                 gpu_memory_utilization=0.3,
                 kv_transfer_config=KVTransferConfig(**kv_transfer_config("plain")), **kwargs)
    prompts = [p.prompt[:2000] for p in load_prompts(EVALUATION_PROMPTS)[::50][:24]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0),
                              use_tqdm=False)
    signatures = [wire.decode(o.kv_transfer_params) for o in outputs]
    layers = wire.decode_moe_layers(outputs[0].kv_transfer_params)
    # Whether vLLM kept async scheduling on (it overlaps the next step's preparation with the
    # forward; eldr's per-step path must not break that, stages/capture/host_copy.py).
    overlapped = bool(engine.llm_engine.vllm_config.scheduler_config.async_scheduling)
    np.savez(out, signatures=np.stack(signatures), moe_layers=np.array(layers),
             async_scheduling=np.array(overlapped))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
