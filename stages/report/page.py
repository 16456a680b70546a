"""The report as one HTML page that needs nothing else: plots inlined as base64 PNGs, styles
inline, no scripts, and a Content-Security-Policy that forbids loading anything, so the file
can be mailed or attached and reads the same anywhere. Every piece of text from the inputs
(policy names, paths, commands, notes) is escaped.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from stages.bench.metric_registry import COLUMNS, OVER_BEST
from stages.report.inputs import (
    ComparisonTable,
    DialTable,
    FitSummary,
    Plot,
    Provenance,
    ReportInputs,
    ResultsFolder,
)

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1{margin-bottom:.2em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:right}
th:first-child,td:first-child,table.kv td,table.kv th{text-align:left}
thead th{background:#f4f4f4}code{background:#f4f4f4;padding:0 .2em;word-break:break-all}
.verdict{font-size:1.1em;padding:.6em 1em;background:#f6f8fa;border-left:4px solid #4a7}
.muted{color:#777}figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.85em;color:#555}
"""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def figure(value: float) -> str:
    """A table figure as the bench's terminal table prints it (``stages.bench.report``)."""
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return "-"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.2f}"


def render(inputs: ReportInputs, now: datetime | None = None) -> str:
    now = now or datetime.now(timezone.utc)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # Nothing may load from anywhere: the page is complete as it is.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none';"
        " img-src data:; style-src 'unsafe-inline'\">",
        "<title>eldr report</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>eldr report</h1>",
        f"<p class=\"muted\">written {esc(now.strftime('%Y-%m-%d %H:%M UTC'))}"
        f" {_by(inputs.provenance)}</p>",
        _inputs_list(inputs),
        _verdict_section(inputs.fits),
        _dial_section(inputs.fits, inputs.folders),
        _results_section("Live results", True, inputs.folders),
        _results_section("Simulated results", False, inputs.folders),
        _fit_section(inputs.fits),
        _provenance_section(inputs),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _by(p: Provenance) -> str:
    return (f"by eldr {esc(p.eldr_version or 'unknown')}, vLLM"
            f" {esc(p.vllm_version or 'not installed')}: <code>{esc(p.command or '')}</code>")


def _inputs_list(inputs: ReportInputs) -> str:
    items = [f"<li>results folder <code>{esc(f.path)}</code></li>" for f in inputs.folders]
    items += [f"<li>artifact <code>{esc(f.version)}</code> in <code>{esc(f.store)}</code></li>"
              for f in inputs.fits]
    return f"<p>Inputs:</p><ul>{''.join(items)}</ul>"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    """A table of already escaped cells."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _kv(pairs: Iterable[tuple[str, str]]) -> str:
    """Key/value rows, both escaped here."""
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in pairs)
    return f'<table class="kv"><tbody>{rows}</tbody></table>'


def _img(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    return (f'<figure><img alt="{esc(plot.name)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{esc(plot.name)}</figcaption></figure>")


def _provenance_line(p: Provenance, missing: str = "written before eldr stored them") -> str:
    if p.command is None and p.eldr_version is None:
        return f'<p class="muted">command and versions not recorded ({esc(missing)})</p>'

    return (f"<p>eldr {esc(p.eldr_version or 'unknown')}, vLLM"
            f" {esc(p.vllm_version or 'not installed')}:"
            f" <code>{esc(p.command or 'command not recorded')}</code></p>")


# -- sections ---------------------------------------------------------------------------------


def _verdict_section(fits: Sequence[FitSummary]) -> str:
    out = ["<h2>Verdict</h2>"]
    if not fits:
        out.append('<p class="muted">no `eldr fit` artifact in this report: no verdict</p>')
    for fit in fits:
        out.append(f"<p>artifact <code>{esc(fit.version)}</code>, {esc(fit.model)},"
                   f" k={esc(fit.params.get('k', '?'))}:</p>")
        out.append(f'<p class="verdict">{esc(fit.verdict)}</p>')
    return "\n".join(out)


def _dial_section(fits: Sequence[FitSummary], folders: Sequence[ResultsFolder]) -> str:
    out = ["<h2>Locality dial</h2>"]
    for fit in fits:
        out.append(f"<h3>artifact {esc(fit.version)}</h3>")
        if fit.dial is None:
            out.append("<p>not computed</p>")
        elif fit.dial_line is None:
            out.append(_value(fit.dial))
        else:
            # <details> folds the stored numbers under the sentence, with no script.
            out.append(f'<p class="verdict">{esc(fit.dial_line)}</p><details><summary>the'
                       f" dial's stored figures</summary>{_value(fit.dial)}</details>")
    for folder in folders:
        for dial in folder.dials:
            out.append(_dial_table(folder, dial))
        out += [_img(p) for p in folder.plots if p.kind == "dial"]
    if len(out) == 1:
        out.append('<p class="muted">not computed: no artifact and no locality sweep'
                   " (`eldr bench --simulate --locality-blend 0,0.5,1`) in this report</p>")
    return "\n".join(out)


def _dial_table(folder: ResultsFolder, dial: DialTable) -> str:
    header = ["policy", *(f"s={s:g}" for s in dial.strengths)]
    rows = []
    for name, ratios in dial.ratios.items():
        cells = [" / ".join(figure(ratios[m.key][i]) if i < len(ratios[m.key]) else "-"
                            for m in OVER_BEST) for i in range(len(dial.strengths))]
        rows.append([esc(name), *cells])
    mark = dial.data_mark
    where = ("" if mark is None else
             f"<p>your data: s = {figure(_float(mark.get('strength')))}"
             f" ({esc(mark.get('source', ''))})</p>")
    return (f"<h3>{esc(dial.source)}, {esc(dial.request_rate)} req/s</h3>"
            f"<p class=\"muted\">in <code>{esc(folder.path)}</code>; cells: "
            + " / ".join(esc(m.label) for m in OVER_BEST)
            + " over the best load balancer at that strength</p>"
            + _table(header, rows) + where + _provenance_line(dial.provenance))


def _results_section(title: str, live: bool, folders: Sequence[ResultsFolder]) -> str:
    kind = "live" if live else "simulated"
    out = [f"<h2>{esc(title)}</h2>"]
    for folder in folders:
        tables = [t for t in folder.tables if t.live == live]
        plots = [p for p in folder.plots if p.kind == kind]
        if not tables and not plots:
            continue
        out.append(f"<h3><code>{esc(folder.path)}</code></h3>")
        out += [_comparison(t) for t in tables]
        out += [_img(p) for p in plots]
    if len(out) == 1:
        out.append(f'<p class="muted">no {kind} results in this report</p>')
    return "\n".join(out)


def _comparison(table: ComparisonTable) -> str:
    header = ["policy", *(esc(c.label) for c in COLUMNS),
              *(f"{esc(m.label)} /best" for m in OVER_BEST)]
    rows = [
        [esc(name), *(figure(m[c.key]) for c in COLUMNS),
         *(figure(table.ratios[name][o.key]) for o in OVER_BEST)]
        for name, m in table.metrics.items()
    ]
    notes = [f"{esc(m.label)} {esc(best[0])} {figure(best[1])} {esc(m.unit)}"
             for m in OVER_BEST if (best := table.best[m.key]) is not None]
    footnote = ("best load balancer: " + ", ".join(notes) if notes
                else "no load balancer in this run: no /best ratios")
    kind = "live" if table.live else "simulated"
    return "\n".join([
        f"<h4>{kind}, {esc(table.request_rate)} req/s"
        f"{', ' + esc(table.date) if table.date else ''}</h4>",
        _kv(table.details),
        _table(header, rows),
        f'<p class="muted">{footnote}; latencies in ms; experts/L = distinct experts per MoE'
        " layer per decode step</p>",
        *(_provenance_line(p) for p in table.provenance),
    ])


def _fit_section(fits: Sequence[FitSummary]) -> str:
    out = ["<h2>Fit</h2>"]
    if not fits:
        out.append('<p class="muted">no `eldr fit` artifact in this report</p>')
    for fit in fits:
        out.append(f"<h3>artifact {esc(fit.version)}</h3>")
        out.append(_kv([("model", fit.model), ("created", fit.created),
                        ("store", str(fit.store))]))
        for name, gain in (("expected gain (cross-fit)", fit.expected_gain),
                           ("held-out gain (the artifact's own centroids)", fit.holdout_gain)):
            out.append(f"<h4>{esc(name)}</h4>")
            out.append('<p class="muted">not computed</p>' if gain is None else _gain(gain))
        out += [f"<p>warning: {esc(w)}</p>" for w in fit.warnings]
        out.append("<h4>fit parameters</h4>" + _value(fit.params))
        if fit.plot is not None:
            out.append(_img(fit.plot))
        out.append(_provenance_line(fit.provenance, "the artifact does not store them"))
    return "\n".join(out)


def _gain(gain: dict[str, Any]) -> str:
    """Per batch size, as `eldr fit` prints it: distinct experts per layer per step in
    same-cluster and random batches, the change with its interval, and the TPOT change the
    cost model predicts."""
    cost = gain.get("cost_model")
    header = ["batch", "same-cluster", "random", "distinct experts/layer/step"]
    header += [f"TPOT ({esc(cost)} cost)"] if cost else []
    header.append("verdict")
    rows = []
    for row in gain.get("batches", []):
        if not isinstance(row, dict):
            continue
        batch = f"<td>{esc(row.get('batch_size', '?'))}</td>"
        if "change" not in row:
            # Why a batch size was not estimated spans the figures it has none of.
            rows.append(f"<tr>{batch}<td colspan=\"{len(header) - 1}\">not estimated:"
                        f" {esc(row.get('skipped', ''))}</td></tr>")
            continue
        cells = [figure(_float(row.get("same_cluster_distinct_experts_per_layer"))),
                 figure(_float(row.get("random_distinct_experts_per_layer"))),
                 _change(row.get("change"), row.get("change_ci"))]
        if cost:
            cells.append(_change(row.get("tpot_change"), row.get("tpot_change_ci")))
        cells.append(esc(row.get("verdict", "")))
        rows.append(f"<tr>{batch}" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in header)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _float(value: object) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def _change(point: object, interval: object) -> str:
    if not isinstance(point, int | float):
        return "-"
    text = f"{point:+.1%}"
    if isinstance(interval, list) and len(interval) == 2:
        text += f" [{_float(interval[0]):+.1%}, {_float(interval[1]):+.1%}]"
    return esc(text)


def _value(value: Any) -> str:
    """A stored JSON value whose shape this page does not know (the dial entry, the fit's
    params): objects as key/value tables, anything else as compact JSON."""
    if isinstance(value, dict):
        rows = "".join(f"<tr><th>{esc(k)}</th><td>{_value(v)}</td></tr>"
                       for k, v in value.items())
        return f'<table class="kv"><tbody>{rows}</tbody></table>'
    if isinstance(value, str):
        return esc(value)
    return f"<code>{esc(json.dumps(value))}</code>"


def _provenance_section(inputs: ReportInputs) -> str:
    rows = []
    for folder in inputs.folders:
        stamps = [(f"{'live' if t.live else 'simulated'} {t.request_rate} req/s", p)
                  for t in folder.tables for p in t.provenance]
        stamps += [(f"locality dial {d.request_rate} req/s", d.provenance)
                   for d in folder.dials]
        rows += [[f"<code>{esc(folder.path)}</code>", esc(what), *_stamp(p)]
                 for what, p in stamps]
    rows += [[f"<code>{esc(fit.store)}</code>", f"artifact {esc(fit.version)}",
              *_stamp(fit.provenance)] for fit in inputs.fits]
    return ("<h2>Versions and commands</h2>"
            + _table(["input", "what", "eldr", "vLLM", "command"], rows)
            + f"<p class=\"muted\">this page: {_by(inputs.provenance)}</p>")


def _stamp(p: Provenance) -> list[str]:
    missing = '<span class="muted">not recorded</span>'
    return [esc(p.eldr_version) if p.eldr_version else missing,
            esc(p.vllm_version) if p.vllm_version else
            (missing if p.eldr_version is None else "not installed"),
            f"<code>{esc(p.command)}</code>" if p.command else missing]
