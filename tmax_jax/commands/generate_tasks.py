"""``tmax-jax generate-tasks``: write N procedurally generated tasks, checked in the sandbox pool.

Each task is drawn from the nine-axis sampler (``configs/task_axes.yaml``), written by the best
matching family, then put through the executability filter (environment builds, initial-state
test passes, no-op scores 0, reference solution scores 1); tasks that fail it are removed and the
reason is kept in ``OUT/generation_report.json``.
"""

from __future__ import annotations

import collections
import json
import shutil
import sys
import time
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate-tasks", help="generate TMAX/Harbor tasks procedurally and filter them"
    )
    p.add_argument("--n", type=int, required=True, help="number of tasks to draw")
    p.add_argument("--out", type=Path, required=True, help="output directory (created)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (task i is the same for any --n)")
    p.add_argument("--generator", choices=["procedural"], default="procedural", help="task generator")
    p.add_argument("--corpus-kind", default="rl_v2", help="axis weighting: legacy, sft_v2, rl_v2")
    p.add_argument("--format", choices=["tmax", "harbor"], default="tmax", help="task directory layout")
    p.add_argument("--axes", type=Path, help="axes YAML (default configs/task_axes.yaml)")
    p.add_argument("--no-filter", action="store_true", help="skip the executability filter")
    p.add_argument("--concurrency", type=int, default=0, help="sandboxes for the filter (default: CPU count)")
    p.add_argument(
        "--backend", choices=["bwrap", "podman", "apptainer"], default="bwrap", help="sandbox backend"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from tqdm import tqdm

    from tmax_jax.errors import ConfigError
    from tmax_jax.sandbox import SandboxConfig
    from tmax_jax.tasks.axes import AXES_FILE, AxisSampler
    from tmax_jax.tasks.filter import filter_tasks
    from tmax_jax.tasks.generator import ProceduralGenerator

    if args.n < 1:
        raise ConfigError(f"--n must be >= 1, got {args.n}")
    if args.out.exists() and any(args.out.iterdir()):
        raise ConfigError(f"--out {args.out} exists and is not empty")
    args.out.mkdir(parents=True, exist_ok=True)
    sampler = AxisSampler.from_yaml(args.axes or AXES_FILE, args.corpus_kind)
    gen = ProceduralGenerator(sampler)
    t0 = time.monotonic()
    tty = sys.stderr.isatty()
    made = [
        gen.generate_one(args.out, args.seed, i, args.format)
        for i in tqdm(range(args.n), desc="generate", file=sys.stderr, disable=not tty)
    ]
    t_gen = time.monotonic() - t0
    report = {
        "n": args.n,
        "seed": args.seed,
        "corpus_kind": args.corpus_kind,
        "format": args.format,
        "tasks": [],
    }
    if args.no_filter:
        kept = made
        report["tasks"] = [
            {"path": m.path.name, "family": m.family, "kept": True, "reason": "not filtered"} for m in made
        ]
    else:
        bar = tqdm(total=len(made), desc="filter", file=sys.stderr, disable=not tty)
        results = filter_tasks(
            [m.path for m in made],
            SandboxConfig(backend=args.backend),
            args.concurrency or None,
            progress=lambda r: bar.update(),
        )
        bar.close()
        kept = []
        for m, r in zip(made, results):
            report["tasks"].append(
                {
                    "path": m.path.name,
                    "family": m.family,
                    **{k: v for k, v in r.to_json().items() if k != "path"},
                }
            )
            if r.kept:
                kept.append(m)
            else:
                shutil.rmtree(m.path, ignore_errors=True)
    elapsed = time.monotonic() - t0
    report["kept"] = len(kept)
    report["generate_s"] = t_gen
    report["total_s"] = elapsed
    (args.out / "generation_report.json").write_text(json.dumps(report, indent=2) + "\n")
    fams = collections.Counter(m.family for m in kept)
    doms = collections.Counter(m.signature["domain"] for m in kept)
    print(
        f"{len(kept)}/{args.n} tasks kept in {args.out} ({elapsed:.1f}s, {60 * args.n / max(elapsed, 1e-9):.1f} tasks/min)"
    )
    print("families: " + ", ".join(f"{k} {v}" for k, v in sorted(fams.items())))
    print("domains:  " + ", ".join(f"{k} {v}" for k, v in sorted(doms.items())))
    dropped = [t for t in report["tasks"] if not t["kept"]]
    for t in dropped[:10]:
        print(f"dropped {t['path']}: {t['reason'][:150]}")
    return 0
