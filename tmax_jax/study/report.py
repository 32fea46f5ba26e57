"""A study's comparison as files: ``comparison.json``, ``comparison.md``, ``comparison.csv``, the
figures (PNG) and one HTML page holding the table, the verdicts and the figures."""

from __future__ import annotations

import base64
import csv
import io
import json
from html import escape
from pathlib import Path
from typing import Any

import numpy as np

COLUMNS = [
    ("heldout_before", "held-out before", 100.0, "{:.1f}"),
    ("heldout_after", "held-out after", 100.0, "{:.1f}"),
    ("heldout_gain", "gain (points)", 100.0, "{:+.1f}"),
    ("eval_pass_at_1", "eval pass@1", 100.0, "{:.1f}"),
    ("mismatch", "logprob mismatch", 1.0, "{:.4f}"),
    ("masked_fraction", "masked fraction", 1.0, "{:.4f}"),
    ("staleness_max", "staleness (max)", 1.0, "{:.2f}"),
    ("train_tokens_per_s", "train tokens/s", 1.0, "{:.0f}"),
    ("wall_s", "wall (min)", 1 / 60, "{:.1f}"),
]


def _cell(stat: dict[str, Any], scale: float, fmt: str) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    text = fmt.format(stat["mean"] * scale)
    if stat.get("ci95") is not None:
        text += " ± " + fmt.replace("+", "").format(stat["ci95"] * scale)
    return text


def table_rows(comparison: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and one row per variant: mean ± 95% half-interval over seeds, and the verdict."""
    cols = [c for c in COLUMNS if any(v[c[0]]["mean"] is not None for v in comparison["variants"].values())]
    header = ["variant", "seeds", *[c[1] for c in cols], "verdict"]
    rows = []
    for name, v in comparison["variants"].items():
        rows.append(
            [name, str(len(v["seeds"])), *[_cell(v[k], s, f) for k, _, s, f in cols], v["verdict"]["text"]]
        )
    return header, rows


def markdown(comparison: dict[str, Any]) -> str:
    header, rows = table_rows(comparison)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _curve_mean(runs: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    by_step: dict[int, list[float]] = {}
    for r in runs:
        for step, value in r[key]:
            by_step.setdefault(int(step), []).append(float(value))
    steps = sorted(by_step)
    return steps, [float(np.mean(by_step[s])) for s in steps]


def figures(comparison: dict[str, Any]) -> dict[str, bytes]:
    """PNG bytes of the figures: held-out gain per variant (mean, 95% interval, each seed), and the
    train pass rate and reward per step (mean over seeds) of every variant."""
    from matplotlib.ticker import MaxNLocator

    from tmax_jax.figures import BAR_COLORS, new_figure, wrap_label

    out: dict[str, bytes] = {}
    names = list(comparison["variants"])

    def png(fig) -> bytes:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    fig = new_figure(1.2 + 0.55 * len(names))
    ax = fig.add_subplot()
    for i, name in enumerate(names):
        g = comparison["variants"][name]["heldout_gain"]
        seeds = [100 * r["heldout_gain"] for r in comparison["runs"][name]]
        if g["mean"] is not None:
            err = None if g["ci95"] is None else [100 * g["ci95"]]
            ax.barh([i], [100 * g["mean"]], xerr=err, color=BAR_COLORS[0], alpha=0.75, capsize=4)
        ax.scatter(seeds, [i] * len(seeds), color="#222222", s=14, zorder=3)
    ax.axvline(0, color="#888888", lw=1)
    ax.set_yticks(range(len(names)), [wrap_label(n) for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("held-out pass rate gain (points): mean, 95% interval, each seed")
    out["heldout_gain.png"] = png(fig)

    for key, label, fname in (
        ("train_pass_rate", "train pass rate", "train_pass_rate.png"),
        ("reward", "reward (mean)", "reward.png"),
    ):
        fig = new_figure(4.2)
        ax = fig.add_subplot()
        for name in names:
            steps, ys = _curve_mean(comparison["runs"][name], key)
            if steps:
                ax.plot(steps, ys, marker="." if len(steps) <= 60 else None, label=name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("RL step")
        ax.set_ylabel(f"{label} (mean over seeds)")
        ax.grid(alpha=0.3)
        if names:
            fig.legend(loc="outside lower center", ncols=min(len(names), 4), frameon=False)
        out[fname] = png(fig)
    return out


def html(comparison: dict[str, Any], figs: dict[str, bytes]) -> str:
    header, rows = table_rows(comparison)
    table = "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>"
    for r in rows:
        table += "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>"
    table += "</table>"
    imgs = "".join(
        f'<figure><img alt="{escape(n)}" src="data:image/png;base64,{base64.b64encode(b).decode()}">'
        f"<figcaption>{escape(n.removesuffix('.png').replace('_', ' '))}</figcaption></figure>"
        for n, b in figs.items()
    )
    missing = comparison.get("missing") or []
    note = f"<p class=note>Not finished: {escape(', '.join(missing))}</p>" if missing else ""
    desc = f"<p>{escape(comparison['description'])}</p>" if comparison.get("description") else ""
    return (
        "<!doctype html><html><head><meta charset=utf-8>"
        f"<title>tmax-jax study: {escape(comparison['study'])}</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;"
        "text-align:right;vertical-align:top}th{background:#f3f3f3}td:first-child,td:last-child,"
        "th:first-child,th:last-child{text-align:left}td:last-child{max-width:22em}"
        "img{max-width:100%}figure{margin:1.5em 0}.note{color:#a33}"
        "</style></head><body>"
        f"<h1>Study: {escape(Path(comparison['study']).name)}</h1>{desc}"
        f"<p>Baseline: <b>{escape(comparison['baseline'])}</b>; seeds {comparison['seeds']}. Numbers are "
        "means over seeds ± the 95% Student-t half-interval; a verdict compares a variant's mean held-out "
        "gain with the baseline's (Welch's t interval of the difference).</p>"
        f"{note}{table}{imgs}</body></html>\n"
    )


def write_report(comparison: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write every file of the comparison under ``out``; returns them by kind."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "comparison.json",
        "md": out / "comparison.md",
        "csv": out / "comparison.csv",
        "html": out / "comparison.html",
    }
    paths["json"].write_text(json.dumps(comparison, indent=2) + "\n")
    paths["md"].write_text(markdown(comparison))
    header, rows = table_rows(comparison)
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    figs = figures(comparison)
    for name, data in figs.items():
        (out / name).write_bytes(data)
        paths[name] = out / name
    paths["html"].write_text(html(comparison, figs))
    return paths
