"""What `eldr report` shows, read from the folders `eldr bench` and `eldr fit` wrote.

A results folder holds one ``<policy>-<rate>qps.json`` per policy and rate (live or
simulated: a live file has per-request lists), ``sim-locality-dial-<rate>qps.json`` for a
locality sweep, and PNG plots; an artifact store holds ``<version>/manifest.json`` and a
``latest`` pointer. Everything is read into the typed model below, with the comparison's ratios
already computed, so the page renderer only formats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from stages import paths
from stages.bench.metric_registry import COLUMNS, OVER_BEST
from stages.bench.report import best_baseline, ratios_to_best
from stages.bench.results import live_shape
from stages.errors import EldrError
from stages.provenance import KEYS, provenance

DIAL_PREFIX = "sim-locality-dial-"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Provenance:
    """Versions and command line a file recorded; None where it predates recording them."""

    eldr_version: str | None = None
    vllm_version: str | None = None
    command: str | None = None

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> Provenance:
        found = {key: doc.get(key) for key in KEYS}
        return cls(**{k: v if isinstance(v, str) else None for k, v in found.items()})


@dataclass(frozen=True)
class Plot:
    name: str  # the PNG's file name, which says what it shows
    png: bytes
    kind: str  # "live", "simulated", "dial" or "fit": the section it belongs to


@dataclass(frozen=True)
class ComparisonTable:
    """Every policy at one request rate of one run, as the bench's terminal table."""

    live: bool
    request_rate: str  # as in the file names: "2", "inf"
    metrics: dict[str, dict[str, float]]  # policy -> COLUMNS key -> value (NaN: none)
    ratios: dict[str, dict[str, float]]  # policy -> OVER_BEST key -> over the best balancer
    best: dict[str, tuple[str, float] | None]  # OVER_BEST key -> best load balancer
    details: tuple[tuple[str, str], ...]  # what ran: model, cluster, tokens...
    date: str
    provenance: tuple[Provenance, ...]  # distinct over the policies' files


@dataclass(frozen=True)
class DialTable:
    """A locality sweep: each policy's TPOT over the best load balancer at each strength."""

    request_rate: str
    source: str
    strengths: tuple[float, ...]
    ratios: dict[str, dict[str, list[float]]]  # policy -> OVER_BEST key -> per strength
    data_mark: dict[str, Any] | None  # where the user's data sits on the dial
    provenance: Provenance


@dataclass(frozen=True)
class ResultsFolder:
    path: Path
    tables: tuple[ComparisonTable, ...]
    dials: tuple[DialTable, ...]
    plots: tuple[Plot, ...]


@dataclass(frozen=True)
class FitSummary:
    """One artifact: its verdict, gain estimates, dial entry and what produced it."""

    version: str
    store: Path
    created: str
    model: str
    params: dict[str, Any]
    verdict: str  # the sentence `eldr fit` prints, or why there is none
    expected_gain: dict[str, Any] | None  # cross-fitted estimate (``stages.fit.gain``)
    holdout_gain: dict[str, Any] | None  # the held-out split's, with the artifact's centroids
    dial: Any  # the metrics' "dial" entry; None: not computed by this fit
    dial_line: str | None  # the sentence `eldr fit` prints of it, where this eldr can
    warnings: tuple[str, ...]
    plot: Plot | None
    provenance: Provenance


@dataclass(frozen=True)
class ReportInputs:
    folders: tuple[ResultsFolder, ...]
    fits: tuple[FitSummary, ...]
    provenance: Provenance  # of the `eldr report` run itself


def gather(given: Sequence[Path]) -> ReportInputs:
    """The inputs at ``given`` (results folders, artifact stores or artifact version
    folders); none given: every results folder in the default place, newest first, and the
    default store's latest artifact."""
    folders: list[ResultsFolder] = []
    fits: list[FitSummary] = []
    for path in _dedupe(given) if given else _defaults():
        artifact = _artifact_at(path)
        if artifact is not None:
            fits.append(_fit_summary(*artifact))
            continue
        folder = read_results_folder(path)
        if folder is None:
            raise EldrError(
                f"{path} holds no eldr results: no <policy>-<rate>qps.json from `eldr bench`,"
                f" no {DIAL_PREFIX}<rate>qps.json, and no `eldr fit` artifact (manifest.json or"
                " a 'latest' pointer)"
            )
        folders.append(folder)
    if not folders and not fits:
        raise EldrError(
            f"nothing to report: no results in {paths.default_result_dir()} and no artifact in"
            f" {paths.default_artifact_store()}; run `eldr fit` or `eldr bench`, or pass the"
            " folders they wrote"
        )
    return ReportInputs(tuple(folders), tuple(fits), Provenance.of(provenance()))


def _dedupe(given: Sequence[Path]) -> list[Path]:
    out: list[Path] = []
    for raw in given:
        path = Path(raw).resolve()
        if not path.exists():
            raise EldrError(f"{raw} does not exist")
        if not path.is_dir():
            raise EldrError(f"{raw} is not a folder: pass a results folder `eldr bench` wrote"
                            " (--result-dir) or an artifact store `eldr fit` wrote")
        if path not in out:
            out.append(path)
    return out


def _defaults() -> list[Path]:
    """The default results folder and its subfolders (the demo's sim-gpu...) that hold
    results, newest first, then the default artifact store if it has a latest artifact."""
    root = paths.default_result_dir()
    candidates = [root, *sorted(root.iterdir())] if root.is_dir() else []
    found = [(newest, d) for d in candidates if d.is_dir() and (newest := _newest_result(d))]
    chosen = [d for _, d in sorted(found, key=lambda item: item[0], reverse=True)]
    store = paths.default_artifact_store()
    return [*chosen, store] if (store / "latest").is_file() else chosen


def _newest_result(folder: Path) -> float:
    """The newest result file's modification time in ``folder``; 0 without one."""
    return max((p.stat().st_mtime for p in folder.glob("*qps.json")), default=0.0)


# -- results folders --------------------------------------------------------------------------


def read_results_folder(folder: Path) -> ResultsFolder | None:
    """The comparisons, dials and plots in ``folder``; None when it holds no result file."""
    by_run: dict[tuple[bool, str], list[dict[str, Any]]] = {}
    dials = []
    for path in sorted(folder.glob("*qps.json")):
        doc = _read_json(path)
        if path.name.startswith(DIAL_PREFIX) and "strengths" in doc:
            dials.append(_dial(doc))
        elif "policy" in doc and "request_rate" in doc:
            live = isinstance(doc.get("start_times"), list)  # per-request lists: live only
            by_run.setdefault((live, _rate(doc["request_rate"])), []).append(doc)
    if not by_run and not dials:
        return None
    # Live first, then by rate, as a sweep reads.
    order = sorted(by_run, key=lambda key: (not key[0], _rate_value(key[1])))
    tables = tuple(_table(live, rate, by_run[live, rate]) for live, rate in order)
    has_live = any(t.live for t in tables)
    plots = tuple(_plot(p, _plot_kind(p.name, has_live)) for p in sorted(folder.glob("*.png")))
    return ResultsFolder(folder, tables, tuple(dials),
                         tuple(p for p in plots if p is not None))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise EldrError(f"{path} is not a readable JSON result file: {exc}") from exc
    if not isinstance(doc, dict):
        raise EldrError(f"{path} is not an eldr result file (not a JSON object)")
    return doc


def _rate(value: object) -> str:
    """The rate as the file names spell it; the bench stores infinity as "inf"."""
    number = _num(value)
    return "inf" if value == "inf" or math.isinf(number) else f"{number:g}"


def _rate_value(label: str) -> float:
    return math.inf if label == "inf" else float(label)


def _num(value: object) -> float:
    """A stored figure; JSON null (a statistic over nothing) and non-numbers NaN. Integers
    stay integers (a count of failed requests prints as one, as in the bench's table)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return value


def _policy_order(docs: Sequence[dict[str, Any]]) -> list[str]:
    """The order the bench ran them (a live run records it), else the policy registry's,
    which is the bench's default order."""
    from stages.routing.policies import POLICIES

    names = [str(d["policy"]) for d in docs]
    ran = docs[0].get("policy_order")
    registry = list(POLICIES)
    rank = {n: i for i, n in enumerate(dict.fromkeys(ran))} if isinstance(ran, list) else {
        n: i for i, n in enumerate(registry)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def _table(live: bool, rate: str, docs: list[dict[str, Any]]) -> ComparisonTable:
    by_name = {str(d["policy"]): d for d in docs}
    metrics = {
        name: {c.key: _num(by_name[name].get(c.key)) for c in COLUMNS}
        for name in _policy_order(docs)
    }
    best = {m.key: best_baseline(metrics, m.key) for m in OVER_BEST}
    return ComparisonTable(
        live=live, request_rate=rate, metrics=metrics, ratios=ratios_to_best(metrics),
        best=best, details=_details(live, docs), date=_date(docs[0].get("date")),
        provenance=tuple(dict.fromkeys(Provenance.of(d) for d in docs)),
    )


def _date(stamp: object) -> str:
    """``20260412-101500`` (the bench's stamp, UTC, as vLLM's) as ``2026-04-12 10:15 UTC``."""
    from datetime import datetime

    try:
        return datetime.strptime(str(stamp), "%Y%m%d-%H%M%S").strftime("%Y-%m-%d %H:%M UTC")
    except ValueError:
        return "" if stamp is None else str(stamp)


def _details(live: bool, docs: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    """What a reader needs to know of the run beyond its figures (its command says the rest:
    a simulation's files do not name its cluster or cost model)."""
    first = docs[0]
    sent = (_num(d.get("completed")) + _num(d.get("failed")) for d in docs)
    counts = sorted({int(n) for n in sent if math.isfinite(n)})
    span = "unknown" if not counts else (
        str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}")
    out = [("requests per policy", span)]
    if live:
        keys = (("model", "model_id"), ("proxy", "url"), ("output tokens", "max_tokens"),
                ("rounds", "rounds"), ("concurrency cap", "max_concurrency"),
                ("prompts", "prompts_path"))
        out.insert(0, ("workers", live_shape(first) or "unknown"))
        out += [(label, str(first[key])) for label, key in keys if first.get(key) is not None]
        states = first.get("proxy_state")
        state = next(iter(states.values()), None) if isinstance(states, dict) and states else None
        if isinstance(state, dict) and state.get("artifact_version"):
            out.append(("artifact", str(state["artifact_version"])))
    else:
        proxies = first.get("proxies")
        if isinstance(proxies, int) and proxies > 1:
            out.append(("proxies", f"{proxies} ({_num(first.get('publish_delay_ms')):g} ms"
                                   " publish delay)"))
    return tuple(out)


def _dial(doc: dict[str, Any]) -> DialTable:
    policies = doc.get("policies") if isinstance(doc.get("policies"), dict) else {}
    ratios = {
        str(name): {m.key: [_num(v) for v in entry.get(f"{m.key}_over_best_balancer", [])]
                    for m in OVER_BEST}
        for name, entry in policies.items() if isinstance(entry, dict)
    }
    mark = doc.get("data_mark")
    return DialTable(
        request_rate=_rate(doc.get("request_rate", "inf")), source=str(doc.get("source", "")),
        strengths=tuple(_num(s) for s in doc.get("strengths", [])), ratios=ratios,
        data_mark=mark if isinstance(mark, dict) else None, provenance=Provenance.of(doc),
    )


def _plot_kind(name: str, has_live: bool) -> str:
    """Simulated plots carry the ``sim-`` prefix (``eldr bench --simulate``'s own); the rest
    are the live bench's, or the folder's only kind."""
    if name.startswith(DIAL_PREFIX):
        return "dial"
    if name.startswith("sim-") or not has_live:
        return "simulated"
    return "live"


def _plot(path: Path, kind: str) -> Plot | None:
    data = path.read_bytes()
    return Plot(path.name, data, kind) if data.startswith(PNG_MAGIC) else None


# -- artifacts --------------------------------------------------------------------------------


def _artifact_at(path: Path) -> tuple[Path, str] | None:
    """(store, version) when ``path`` is an artifact store or one version's folder."""
    from stages.fit.artifact import LATEST, MANIFEST

    if (path / MANIFEST).is_file():
        return path.parent, path.name
    if (path / LATEST).is_file():
        return path, "latest"
    return None


def _fit_summary(store_root: Path, version: str) -> FitSummary:
    from stages.fit.artifact import ArtifactStore

    # A full load: a damaged artifact is refused here as `eldr serve` would refuse it.
    artifact = ArtifactStore(store_root).load(version)
    metrics = artifact.metrics
    png = store_root / artifact.version / "fit.png"
    warnings = metrics.get("warnings")
    return FitSummary(
        version=artifact.version, store=store_root, created=artifact.created,
        model=artifact.identity.describe(), params=artifact.params,
        verdict=_verdict(metrics.get("expected_gain")),
        expected_gain=_dict_or_none(metrics.get("expected_gain")),
        holdout_gain=_dict_or_none(metrics.get("holdout_gain")),
        dial=metrics.get("dial"), dial_line=_dial_line(metrics.get("dial")),
        warnings=tuple(str(w) for w in warnings) if isinstance(warnings, list) else (),
        plot=_plot(png, "fit") if png.is_file() else None,
        provenance=_fit_provenance(artifact.provenance, artifact.params, metrics),
    )


def _dict_or_none(value: object) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _verdict(gain: object) -> str:
    """The verdict sentence `eldr fit` printed, from the stored estimate."""
    from stages.fit.gain_report import verdict_line

    if not isinstance(gain, dict):
        return "not computed: this artifact predates the gain estimate (refit with `eldr fit`)"
    try:
        return verdict_line(gain)
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        return f"unreadable: the artifact's expected_gain lacks {exc}"


def _dial_line(dial: object) -> str | None:
    """The fit stage's own sentence for its dial entry; None where this eldr has no such
    sentence or the entry is not in the shape it reads (the page then shows the entry's
    fields as stored)."""
    if not isinstance(dial, dict):
        return None
    try:
        from stages.fit.dial import dial_line
    except ImportError:
        return None
    try:
        return dial_line(dial)
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def _fit_provenance(*sources: Mapping[str, Any]) -> Provenance:
    """Versions and command where the fit stored them (params or metrics); artifacts written
    before `eldr fit` recorded them have none."""
    found = [Provenance.of(s) for s in sources]
    return Provenance(*(next((getattr(p, k) for p in found if getattr(p, k)), None)
                        for k in KEYS))
