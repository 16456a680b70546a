"""A worker's ``/metrics`` page (Prometheus text) read sample by sample, and what a counter
counted between two scrapes: the one reader the bench's counters (cache, decode experts) share.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

from stages.errors import EldrError


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
