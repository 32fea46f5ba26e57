"""``tmax-jax study STUDY.yaml``: run a study's variants x seeds (resumably) and write the comparison."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "study",
        help="run every variant x seed of a study (a base config and named overrides) and compare them",
    )
    p.add_argument("study", help="study YAML (see configs/studies/)")
    p.add_argument("--out", help="study directory (default: the study's out)")
    p.add_argument(
        "--print-commands",
        action="store_true",
        help="print each run's tmax-jax commands (for a launcher to spread over hosts) and exit",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="write the comparison of the runs finished so far; start none",
    )
    p.set_defaults(func=run, uses_jax=False)


def run(args) -> int:
    from tmax_jax.study import StudyInterrupted, commands, compare, load_study, run_study, write_report

    study = load_study(args.study, out=args.out)
    if args.print_commands:
        print("\n".join(commands(study)))
        return 0
    status: dict[str, str] = {}
    if not args.report_only:
        try:
            status = run_study(study)
        except StudyInterrupted as e:
            print(f"[study] {e}")
            paths = write_report(compare(study), study.out)
            print(f"[study] partial comparison: {paths['html']}")
            return 130
    comparison = compare(study)
    paths = write_report(comparison, study.out)
    for name, v in comparison["variants"].items():
        print(f"[study] {name}: {v['verdict']['text']}")
    print(f"[study] comparison: {paths['html']} (table: {paths['md']})")
    failed = [n for n, s in status.items() if s.startswith("failed")]
    if failed:
        print(f"[study] failed runs: {', '.join(failed)} (run the study again to retry them)")
        return 1
    return 0
