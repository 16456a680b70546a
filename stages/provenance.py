"""What produced a saved file: eldr's and vLLM's versions and the command line.

Written beside a run's figures so that a shared report (``eldr report``) can say how to
reproduce each number; the figures alone do not name the cluster shape or cost model a
simulation ran with, but its command does.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from stages.paths import REPO_ROOT

# The keys every writer stores and ``stages.report`` reads back.
KEYS = ("eldr_version", "vllm_version", "command")


@cache
def eldr_version() -> str:
    """eldr's release, with the checkout's commit when it runs from one: the release number
    stays the same across commits, the commit says which code produced a figure."""
    try:
        release = version("eldr")
    except PackageNotFoundError:
        release = "unknown"
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{release} (git {commit})" if commit else release


def command_line(argv: list[str] | None = None) -> str:
    """The command as the user typed it: ``eldr ...`` whether it ran as the ``eldr`` script
    or ``python -m eldr_cli``."""
    argv = sys.argv if argv is None else argv
    program = Path(argv[0]).name if argv else ""
    if program in ("eldr", "__main__.py"):
        program = "eldr"
    return shlex.join([program, *argv[1:]])


def provenance() -> dict[str, str | None]:
    """``KEYS`` for this process (vLLM as installed here: None where it is not)."""
    from stages.vllm_compat import installed_vllm

    return {"eldr_version": eldr_version(), "vllm_version": installed_vllm(),
            "command": command_line()}
