"""The yardstick for "outputs unchanged": greedy outputs of plain vLLM (its default, compiled
mode, no eldr connector) for a few prompts, computed once per test run.

The engine runs in an environment where eldr's plugin refuses this vLLM release (a
``sitecustomize`` makes eldr's gate find it never run and lacking a touchpoint, in every
process vLLM spawns), so the same engine also shows that eldr installed beside vLLM never stops an
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


MISSING_TOUCHPOINT = "vllm.eldr_gone:Gone"


def untested_release_env(root: Path) -> dict[str, str]:
    """Environment variables under which eldr's gate refuses this vLLM release: it was never
    run, and it lacks a touchpoint (one no release has, added in every process)."""
    shim = root / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import stages.vllm_compat as compat\nimport stages.vllm_touchpoints as points\n"
        "compat.RUN_MINORS = ()\n"
        "points.TOUCHPOINTS = (*points.TOUCHPOINTS, points.Touchpoint("
        f"{MISSING_TOUCHPOINT!r}, points.Check.NAME, 'nothing: a test'))\n"
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
    from tests.conftest import wait_ready

    server = VllmServer(ServerSpec(model=str(model), port=port, served_name="tiny",
                                   eldr_plugin=False, extra_env=untested_release_env(root)),
                        root / "logs")
    try:
        wait_ready(server, timeout_s=300)
        return {p: complete(server.url, p) for p in PROMPTS}
    finally:
        server.stop()
