"""The documents claim only what a run showed: while no GPU run is in docs/results.md,
pipeline and expert parallel workers (GPU only) are "not run yet", never "recorded"."""

from __future__ import annotations

import re

from stages.paths import REPO_ROOT


def _text(name: str) -> str:
    return " ".join((REPO_ROOT / name).read_text().split())  # line breaks as spaces


def test_pipeline_and_expert_parallel_are_not_claimed_before_a_gpu_run() -> None:
    if "Figures from GPUs: none yet" not in _text("docs/results.md"):
        return  # a GPU run is recorded: the claims are the results' to back
    for name in ("README.md", "docs/deploying.md"):
        text = _text(name)
        claim = re.search(r"(pipeline|PP)[^.;]*(expert|EP)[^.;]* are recorded", text)
        assert claim is None, f"{name} claims without a run: {claim.group(0)!r}"
        assert "not run yet" in text, name
    where = _text("README.md").split("## Where it runs", 1)[1].split("Limits:", 1)[0]
    assert re.search(r"pipeline and expert parallel[^.]* not run yet", where)
