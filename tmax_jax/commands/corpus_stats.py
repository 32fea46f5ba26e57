"""``tmax-jax corpus-stats DIR``: axis balance and difficulty tables, PNG plots under DIR/stats/."""

from __future__ import annotations

from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("corpus-stats", help="axis balance and difficulty tables of a task corpus")
    p.add_argument("dir", type=Path, help="directory of TMAX/Harbor tasks")
    p.add_argument("--plots", type=Path, help="where to write PNG plots (default DIR/stats)")
    p.set_defaults(func=run, uses_jax=False)


def run(args) -> int:
    from tmax_jax.tasks.axes import AXIS_NAMES
    from tmax_jax.tasks.stats import DIFFICULTY_AXES, corpus_counts, corpus_stats, cross_table, table

    plots = args.plots or args.dir / "stats"
    report = corpus_stats(args.dir, plots)
    n, counts, families = corpus_counts(args.dir)
    print(f"{n} tasks in {args.dir}\n")
    for a in AXIS_NAMES:
        if a in ("skill_type", "primitive_skill", "persona"):
            continue
        print(table(counts[a], n, a) + "\n")
    print("difficulty by domain:\n" + cross_table(args.dir, "domain", "task_complexity") + "\n")
    for a in DIFFICULTY_AXES[1:]:
        print(cross_table(args.dir, "task_complexity", a) + "\n")
    print(table(families, n, "family"))
    print(f"\nplots: {', '.join(Path(p).name for p in report.get('plots', []))} in {plots}")
    return 0
