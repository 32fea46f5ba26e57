"""The HTML report of an evaluation run: tables and inline SVG charts (drawn with matplotlib), one
self-contained file."""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from typing import Any

from tmax_jax.figures import bar_chart_figure, to_svg


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3f}"
    return escape(str(v))


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _chart(labels: list[str], series: Mapping[str, list[float | None]], title: str) -> str:
    """A horizontal bar chart of pass rates as an inline ``<svg>`` (ids salted by the title)."""
    fig = bar_chart_figure(labels, series, title=title, xlabel="pass rate")
    return f'<div class="chart">{to_svg(fig, id_salt=title)}</div>'


def _pass_ks(k: int) -> list[int]:
    """The pass@j columns of per-category and per-task views: pass@1 and pass@k, once each."""
    return sorted({1, k})


def _stats_row(name: str, s: Mapping[str, Any], ks: list[int]) -> list[str]:
    return [
        escape(name),
        _fmt(s["tasks"]),
        _fmt(s["evaluated"]),
        _fmt(s["env_unavailable"]),
        _fmt(s.get("invalid", 0)),
        *[_fmt(s["pass_at"][str(j)]) for j in ks],
        _fmt(s["mean_reward"]),
        _fmt(s["errors"]),
    ]


def _page(title: str, body: str) -> str:
    """One report page: the shared head and style around ``body`` (``title`` is escaped here)."""
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title>\n<style>\n"
        "body { font-family: sans-serif; margin: 2em; }\n"
        "table { border-collapse: collapse; margin: 1em 0; }\n"
        "td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }\n"
        "td:first-child, th:first-child { text-align: left; }\n"
        "table.tasks td:nth-child(-n+3), table.tasks th:nth-child(-n+3) {\n"
        "  text-align: left; white-space: nowrap; }\n"
        "table.tasks td:last-child, table.tasks th:last-child {\n"
        "  text-align: left; min-width: 16em; max-width: 40em; overflow-wrap: anywhere; }\n"
        ".chart svg, img.curve { max-width: 100%; height: auto; }\n"
        "img.curve { width: 800px; }\n"
        f"</style></head><body>\n{body}</body></html>\n"
    )


def _stats_header(ks: list[int]) -> list[str]:
    return [
        "",
        "tasks",
        "evaluated",
        "env unavailable",
        "invalid",
        *[f"pass@{j}" for j in ks],
        "mean reward",
        "errors",
    ]


def _meta_items(d: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    return "".join(f"<li><b>{escape(k)}</b>: {escape(str(d[k]))}</li>" for k in keys if k in d)


def render_html(summary: Mapping[str, Any]) -> str:
    ks: list[int] = summary["ks"]
    k = summary["k"]
    stat_header = _stats_header(ks)
    overall = summary["overall"]
    cats = summary["categories"]
    cat_names = list(cats)
    charts = [
        _chart(
            [f"k={j}" for j in ks],
            {"pass@k": [overall["pass_at"][str(j)] for j in ks]},
            "pass@k (unbiased estimator), all evaluated tasks",
        ),
        _chart(
            cat_names,
            {f"pass@{j}": [cats[c]["pass_at"][str(j)] for c in cat_names] for j in _pass_ks(k)},
            " and ".join(f"pass@{j}" for j in _pass_ks(k)) + " per category",
        ),
    ]
    task_rows = []
    for r in summary["tasks"]:
        log = r.get("log_dir")
        link = f'<a href="{escape(log)}/">{escape(r["task_id"])}</a>' if log else escape(r["task_id"])
        task_rows.append(
            [
                link,
                escape(r["category"]),
                escape(r["status"]),
                f"{r['passes']}/{r['attempts']}",
                *[_fmt(r["pass_at"][str(j)]) for j in _pass_ks(k)],
                _fmt(r["mean_reward"]),
                escape(r.get("reason", "")),
            ]
        )
    task_header = ["task", "category", "status", "passed", *[f"pass@{j}" for j in _pass_ks(k)]]
    task_header += ["mean reward", "note"]
    meta_items = _meta_items(summary, ("agent", "model", "harness", "tasks_dir", "started", "elapsed_s"))
    body = f"""<h1>Evaluation report</h1>
<ul>{meta_items}</ul>
<p>pass@j is the unbiased estimator of Chen et al. (2021) averaged over evaluated tasks; tasks whose
environment cannot be built offline are listed as "environment unavailable", malformed task dirs as
"invalid", and neither is scored.</p>
<h2>Overall</h2>
{_table(stat_header, [_stats_row("all", overall, ks)])}
{charts[0]}
<h2>Per category</h2>
{_table(stat_header, [_stats_row(c, cats[c], ks) for c in cat_names])}
{charts[1]}
<h2>Tasks</h2>
{_table(task_header, task_rows, cls="tasks")}
"""
    return _page(f"tmax-jax eval: {summary.get('agent', '')}", body)


def render_before_after_html(summary: Mapping[str, Any]) -> str:
    """A train run's held-out pass rates before and after RL, overall, per family and per axis value
    (``summary.json`` of ``tmax-jax train``: ``pass_rate_by_family``, ``pass_rate_by_axis``)."""

    def row(name: str, e: Mapping[str, Any]) -> list[str]:
        b, a = e.get("before"), e.get("after")
        delta = a - b if a is not None and b is not None else None
        return [escape(name), str(e.get("tasks", "")), _fmt(b), _fmt(a), _fmt(delta)]

    header = ["", "held-out tasks", "before", "after", "change"]
    overall = {
        "before": summary.get("pass_rate_before"),
        "after": summary.get("pass_rate_after"),
        "tasks": summary.get("heldout_tasks"),
    }
    fams = summary.get("pass_rate_by_family") or {}
    sections = [f"<h2>Overall</h2>{_table(header, [row('all', overall)])}"]
    sections.append(f"<h2>Per family</h2>{_table(header, [row(f, e) for f, e in fams.items()])}")
    if fams:
        names = ["all", *fams]
        entries = [overall, *fams.values()]
        sections.append(
            _chart(
                names,
                {when: [e.get(when) for e in entries] for when in ("before", "after")},
                "held-out pass rate before and after RL",
            )
        )
    for axis, values in (summary.get("pass_rate_by_axis") or {}).items():
        sections.append(
            f"<h2>Per {escape(axis)}</h2>{_table(header, [row(v, e) for v, e in values.items()])}"
        )
    body = f"""<h1>Held-out pass rate before and after RL</h1>
<p>{escape(str(summary.get("run_dir", "")))}: {summary.get("steps")} RL steps; pass rate = passing episodes
over held-out tasks x {summary.get("samples_per_task")} samples, same sampling settings before and after.</p>
{"".join(sections)}
<p><img class="curve" src="learning_curve.png" alt="learning curve"></p>
"""
    return _page(f"tmax-jax train: {summary.get('run_dir', '')}", body)


def render_harness_html(matrix: Mapping[str, Any]) -> str:
    """The report of one agent under several harnesses: a harness x category table of pass@1 (and
    pass@k), each harness linking to its own full report (``summary.harness_matrix``)."""
    ks: list[int] = matrix["ks"]
    k = matrix["k"]
    cats: list[str] = matrix["categories"]
    by = matrix["by_harness"]

    def cell(s: Mapping[str, Any] | None, j: int) -> str:
        if s is None:
            return "n/a"
        return f"{_fmt(s['pass_at'].get(str(j)))} <small>({s['evaluated']})</small>"

    tables = []
    for j in _pass_ks(k):
        rows = [
            [f'<a href="{escape(by[h]["report"])}">{escape(h)}</a>', cell(by[h]["overall"], j)]
            + [cell(by[h]["categories"].get(c), j) for c in cats]
            for h in matrix["harnesses"]
        ]
        tables.append(f"<h2>pass@{j}: harness x category</h2>\n" + _table(["harness", "all", *cats], rows))
    stat_header = _stats_header(ks)
    overall_rows = [_stats_row(h, by[h]["overall"], ks) for h in matrix["harnesses"]]
    chart = _chart(
        list(matrix["harnesses"]),
        {"pass@1": [by[h]["overall"]["pass_at"]["1"] for h in matrix["harnesses"]]},
        "pass@1 per harness, all evaluated tasks",
    )
    meta_items = _meta_items(matrix, ("agent", "model", "tasks_dir"))
    body = f"""<h1>Evaluation report: one agent, every harness</h1>
<ul>{meta_items}<li><b>harnesses</b>: {escape(", ".join(matrix["harnesses"]))}</li></ul>
<p>Each cell is pass@j over that category's evaluated tasks under that harness (the count of
evaluated tasks in brackets); each harness name links to its full report.</p>
{"".join(tables)}
{chart}
<h2>Per harness</h2>
{_table(stat_header, overall_rows)}
"""
    return _page(f"tmax-jax eval by harness: {matrix.get('agent', '')}", body)
