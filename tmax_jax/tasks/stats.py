"""Corpus statistics: axis balance and difficulty tables, and PNG bar charts (drawn with matplotlib)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

from tmax_jax.tasks.axes import AXIS_NAMES
from tmax_jax.tasks.loader import find_tasks, load_task

DIFFICULTY_AXES = ("task_complexity", "command_complexity", "verifier_kind")


def corpus_counts(root: str | Path) -> tuple[int, dict[str, collections.Counter], collections.Counter]:
    """(number of tasks, per-axis value counts, family counts) over every task under ``root``."""
    counts = {a: collections.Counter() for a in AXIS_NAMES}
    families: collections.Counter = collections.Counter()
    n = 0
    for d in find_tasks(root):
        task = load_task(d)
        n += 1
        sig = task.signature or {
            k.removeprefix("axis_"): v for k, v in task.metadata.items() if k.startswith("axis_")
        }
        for a in AXIS_NAMES:
            counts[a][sig.get(a, "unknown")] += 1
        families[task.metadata.get("family", "unknown")] += 1
    return n, counts, families


def table(counts: collections.Counter, n: int, title: str) -> str:
    w = max([len(str(k)) for k in counts] + [len(title)])
    lines = [f"{title:<{w}}  count  share"]
    for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0]))):
        lines.append(f"{k!s:<{w}}  {v:5d}  {100 * v / max(n, 1):5.1f}%")
    return "\n".join(lines)


def cross_table(root: str | Path, rows: str = "domain", cols: str = "task_complexity") -> str:
    grid: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for d in find_tasks(root):
        sig = load_task(d).signature
        grid[sig.get(rows, "unknown")][sig.get(cols, "unknown")] += 1
    col_names = sorted({c for r in grid.values() for c in r})
    w = max([len(r) for r in grid] + [len(rows)])
    out = [f"{rows:<{w}}  " + "  ".join(f"{c:>10}" for c in col_names)]
    for r in sorted(grid):
        out.append(f"{r:<{w}}  " + "  ".join(f"{grid[r][c]:>10}" for c in col_names))
    return "\n".join(out)


def bar_chart(counts: collections.Counter, title: str, path: Path) -> Path:
    """Task counts per value, the most common first, as a horizontal bar chart PNG."""
    from tmax_jax.figures import bar_chart_figure, save_png

    items = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
    fig = bar_chart_figure(
        [str(k) for k, _ in items],
        {"tasks": [v for _, v in items]},
        title=title,
        xlabel="tasks",
        xmax=None,
        value_format="{:d}",
    )
    return save_png(fig, path, dpi=100)


def corpus_stats(root: str | Path, plots_dir: str | Path | None = None) -> dict:
    n, counts, families = corpus_counts(root)
    report = {"tasks": n, "axes": {a: dict(c) for a, c in counts.items()}, "families": dict(families)}
    if plots_dir is not None:
        plots = Path(plots_dir)
        plots.mkdir(parents=True, exist_ok=True)
        report["plots"] = [
            str(bar_chart(counts[a], f"{a} ({n} tasks)", plots / f"{a}.png")) for a in AXIS_NAMES
        ]
        report["plots"].append(str(bar_chart(families, f"families ({n} tasks)", plots / "families.png")))
        (plots / "corpus_stats.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
