"""Procedural task generation: tasks generated and validated per minute, and the share kept.

    python3 benchmarks/bench_generation.py [--n 100] [--seed 0] [--concurrency 2]

Generation (drawing + writing the task dirs, fixtures rendered with Pillow/tesseract/espeak-ng/gcc)
and validation (the executability filter in bwrap sandboxes: initial state, no-op -> 0, reference
solution -> 1) are timed separately in the same run; the ratio says how much the sandbox check
costs against writing the tasks.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

from tmax_jax.sandbox import SandboxConfig
from tmax_jax.tasks.filter import filter_tasks
from tmax_jax.tasks.generator import ProceduralGenerator


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gen = ProceduralGenerator()
        t = time.perf_counter()
        made = [gen.generate_one(Path(tmp) / "corpus", args.seed, i) for i in range(args.n)]
        t_gen = time.perf_counter() - t
        t = time.perf_counter()
        res = filter_tasks(
            [m.path for m in made],
            SandboxConfig(cache_dir=str(Path(tmp) / "cache")),
            args.concurrency or None,
        )
        t_val = time.perf_counter() - t
    kept = sum(r.kept for r in res)
    print(f"generated {args.n} tasks in {t_gen:.1f}s: {60 * args.n / t_gen:.0f} tasks/min")
    print(
        f"validated {args.n} tasks in {t_val:.1f}s: {60 * args.n / t_val:.1f} tasks/min  (x{t_val / t_gen:.1f} the generation time)"
    )
    print(
        f"end to end: {60 * args.n / (t_gen + t_val):.1f} tasks/min; kept {kept}/{args.n} ({100 * kept / args.n:.0f}%)"
    )
    fams = collections.Counter(m.family for m in made)
    print(f"{len(fams)} families drawn: " + ", ".join(f"{k} {v}" for k, v in sorted(fams.items())))
    for r in res:
        if not r.kept:
            print(f"dropped {Path(r.path).name}: {r.reason[:160]}")


if __name__ == "__main__":
    main()
