"""A worker's ``/metrics`` page (Prometheus text) read sample by sample, and what a counter
counted between two scrapes: the one reader the bench's counters (cache, decode experts) share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import fields
from typing import Any, NamedTuple, TypeVar

from stages.errors import EldrError

# A frozen dataclass whose fields are all counters (floats, NaN where a scrape lacked one).
C = TypeVar("C", bound=Any)


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def samples(text: str) -> Iterator[Sample]:
    """Every sample of the page (comments, ``# TYPE`` and blank lines skipped); a line that is
    not Prometheus text is an error naming it."""
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            name, labels, rest = _split_sample(line)
            fields = rest.split()
            if not fields:
                raise ValueError("no value")
            sample = Sample(name, _labels(labels), float(fields[0]))
        except (ValueError, IndexError) as exc:
            raise EldrError(
                f"line {lineno} of a /metrics page is not Prometheus text: {exc}"
            ) from exc
        yield sample


def increase(before: float, after: float) -> float:
    """What a counter counted from ``before`` to ``after``; one that went down means a restart
    in between, and then (as Prometheus' ``increase``) what it counted since is the delta. NaN
    where either scrape lacked it."""
    if math.isnan(before) or math.isnan(after):
        return float("nan")
    return after - before if after >= before else after


def increases(before: C, after: C) -> C:
    """``after - before`` for a dataclass of counters, field by field (``increase``)."""
    return type(after)(*(increase(getattr(before, f.name), getattr(after, f.name))
                         for f in fields(after)))


def summed(items: Iterable[C], empty: C) -> C:
    """A dataclass of counters summed field by field over ``items``; ``empty`` (its fields
    NaN) when there are none, so a missing figure never reads as 0."""
    items = list(items)
    if not items:
        return empty
    return type(empty)(*(sum(getattr(c, f.name) for c in items) for f in fields(empty)))


def _split_sample(line: str) -> tuple[str, str, str]:
    """``name{labels} value [ts]`` -> (name, the label set between its braces, the rest)."""
    brace = line.find("{")
    space = line.find(" ")
    if brace == -1 or (space != -1 and space < brace):
        name, _, rest = line.partition(" ")
        return name, "", rest
    # Label values may hold '}' or spaces inside quotes; walk to the closing brace.
    i, quoted = brace + 1, False
    while i < len(line):
        ch = line[i]
        if quoted and ch == "\\":
            i += 2
            continue
        if ch == '"':
            quoted = not quoted
        elif ch == "}" and not quoted:
            return line[:brace], line[brace + 1 : i], line[i + 1 :]
        i += 1
    raise ValueError(f"unterminated label set in {line!r}")


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.index("=", i)
        key = text[i:eq].strip().lstrip(",").strip()
        if text[eq + 1] != '"':
            raise ValueError(f"unquoted label value in {{{text}}}")
        j, value = eq + 2, []
        while text[j] != '"':
            if text[j] == "\\":
                j += 1
            value.append(text[j])
            j += 1
        out[key] = "".join(value)
        i = j + 1
        while i < len(text) and text[i] in ", ":
            i += 1
    return out
