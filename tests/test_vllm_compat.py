"""eldr names the vLLM releases it is tested on and refuses others with a message."""

from __future__ import annotations

import pytest

from stages import vllm_compat
from stages.errors import EldrError


@pytest.mark.parametrize(
    ("release", "tested"),
    [("0.32.0", True), ("0.31.0", True), ("0.32.1+cpu", True), ("0.33.0", False),
     ("0.30.2", False), ("1.0.0", False)],
)
def test_tested_releases(release: str, tested: bool) -> None:
    assert vllm_compat.is_tested(release) is tested


def test_an_untested_release_is_refused_with_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: "0.34.0")
    with pytest.raises(EldrError, match=r"vLLM 0.34.0 is installed.*0.31, 0.32.x only"):
        vllm_compat.check_vllm()
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: None)
    with pytest.raises(EldrError, match="not installed"):
        vllm_compat.check_vllm()


def test_the_installed_release_is_a_tested_one() -> None:
    release = vllm_compat.installed_vllm()
    if release is None:
        pytest.skip("vLLM is not installed")
    assert vllm_compat.check_vllm() == release
