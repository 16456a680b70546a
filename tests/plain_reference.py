"""The yardstick for "outputs unchanged": greedy outputs of plain vLLM (its default, compiled
mode, no eldr connector) for a few prompts, computed once per test run.

The engine runs in an environment where eldr's plugin refuses this vLLM release (a
``sitecustomize`` narrows eldr's tested releases to one that does not exist, in every process
vLLM spawns), so the same engine also shows that eldr installed beside vLLM never stops an
engine that does not record (``test_engine_guards_real.py``), and the run pays one engine
start, not two.
"""

from __future__ import annotations

from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n",
    "Solve: Maria buys 3 boxes of 12 pencils and gives away 7. How many pencils are left?",
    "Continuez ce texte : La rivière traverse le village avant de rejoindre la mer.",
]
MAX_TOKENS = 12


def untested_release_env(root: Path) -> dict[str, str]:
    """Environment variables under which eldr's plugin finds this vLLM release untested."""
    shim = root / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import stages.vllm_compat as compat\ncompat.TESTED_MINORS = ('0.0',)\n"
    )
    return {"PYTHONPATH": f"{shim}:{REPO}"}


def complete(url: str, prompt: str, timeout: float = 120) -> str:
    """The greedy completion of ``prompt`` (``MAX_TOKENS`` tokens) as ``url`` answers it."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


def plain_outputs(model: Path, port: int, root: Path) -> dict[str, str]:
    """Start the plain engine, answer every prompt, stop it."""
    from stages.engine import ServerSpec, VllmServer

    server = VllmServer(ServerSpec(model=str(model), port=port, served_name="tiny",
                                   eldr_plugin=False, extra_env=untested_release_env(root)),
                        root / "logs")
    try:
        server.wait_ready(timeout_s=300)
        return {p: complete(server.url, p) for p in PROMPTS}
    finally:
        server.stop()
