"""Prompt files: clear errors naming the line; seeded sampling."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from stages.errors import EldrError
from stages.prompts import load_prompts, sample_prompts


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _line(i: int, domain: str = "code") -> str:
    return orjson.dumps({"id": f"p{i}", "prompt": f"text {i}", "domain": domain}).decode()


def test_loads_good_file_skipping_blank_lines(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", [_line(0), "", _line(1, "math")])
    prompts = load_prompts(path)
    assert [(p.id, p.domain) for p in prompts] == [("p0", "code"), ("p1", "math")]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a"]', "expected a JSON object"),
        ('{"id": "x", "prompt": "y"}', "missing key(s) domain"),
        ('{"id": 3, "prompt": "y", "domain": "d"}', "id must be string"),
        ('{"id": "x", "prompt": "", "domain": "d"}', "empty prompt"),
        (None, "duplicate id"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, bad: str | None, message: str) -> None:
    path = _write(tmp_path / "p.jsonl", [_line(0), _line(0) if bad is None else bad])
    with pytest.raises(EldrError) as err:
        load_prompts(path)
    assert f"{path}:2" in str(err.value) and message in str(err.value)


def test_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(EldrError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(EldrError, match="no prompts"):
        load_prompts(_write(tmp_path / "empty.jsonl", [""]))


def test_sampling_is_seeded_and_without_replacement_while_possible(tmp_path: Path) -> None:
    prompts = load_prompts(_write(tmp_path / "p.jsonl", [_line(i) for i in range(50)]))
    a = sample_prompts(prompts, 30, seed=1)
    assert a == sample_prompts(prompts, 30, seed=1)
    assert a != sample_prompts(prompts, 30, seed=2)
    assert len({p.id for p in a}) == 30
    # More than the file holds: whole passes, every prompt once before any twice.
    big = sample_prompts(prompts, 120, seed=0)
    assert len({p.id for p in big[:50]}) == 50
    counts = {p.id: sum(q.id == p.id for q in big) for p in prompts}
    assert set(counts.values()) <= {2, 3}
