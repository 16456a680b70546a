"""Send everything a run prints at the file-descriptor level to a log file, keep the terminal.

vLLM logs from three processes (its engine core and workers inherit stdout and stderr), and
C++ warnings and loading bars bypass Python's logging, so only redirecting descriptors 1 and 2
keeps a terminal clean. The terminal stays reachable through the file this yields, for eldr's
own progress display.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


@contextmanager
def output_to_file(path: Path) -> Iterator[TextIO]:
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(2), "w", buffering=1)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield console
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            console.close()
