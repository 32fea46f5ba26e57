"""``tmax-jax generate-tasks``: write N generated tasks, checked in the sandbox pool.

Each task is drawn from the nine-axis sampler (``configs/task_axes.yaml``) and written by the
procedural generator (the best matching family) or by an LLM behind an OpenAI-compatible endpoint.
The executability filter then keeps a task only when its environment builds, its initial-state test
passes and (with a reference solution) a no-op scores 0 and the solution 1; ``--decontaminate``
drops tasks sharing a 13-gram with a benchmark's instructions. Every dropped task's reason is kept
in ``OUT/generation_report.json``.
"""

from __future__ import annotations

import collections
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate-tasks", help="generate TMAX/Harbor tasks and filter them in sandboxes"
    )
    p.add_argument("--n", type=int, required=True, help="number of tasks to draw")
    p.add_argument("--out", type=Path, required=True, help="output directory (created)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (task i is the same for any --n)")
    p.add_argument("--generator", choices=["procedural", "llm"], default="procedural", help="task generator")
    p.add_argument(
        "--llm-url", help="--generator llm: OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"
    )
    p.add_argument("--model", default="default", help="--generator llm: model name sent to the endpoint")
    p.add_argument(
        "--retries", type=int, default=2, help="--generator llm: retries per stage, error fed back"
    )
    p.add_argument("--max-tokens", type=int, default=1024, help="--generator llm: tokens per answer")
    p.add_argument("--corpus-kind", default="rl_v2", help="axis weighting: legacy, sft_v2, rl_v2")
    p.add_argument("--format", choices=["tmax", "harbor"], default="tmax", help="task directory layout")
    p.add_argument("--axes", type=Path, help="axes YAML (default configs/task_axes.yaml)")
    p.add_argument("--no-filter", action="store_true", help="skip the executability filter")
    p.add_argument("--concurrency", type=int, default=0, help="sandboxes for the filter (default: CPU count)")
    p.add_argument(
        "--backend", choices=["bwrap", "podman", "apptainer"], default="bwrap", help="sandbox backend"
    )
    p.add_argument(
        "--decontaminate", type=Path, help="benchmark task dir: drop tasks sharing a 13-gram with it"
    )
    p.set_defaults(func=run, uses_jax=False)


@dataclass
class _Made:
    path: Path
    family: str
    signature: dict


def _draw(args, sampler, report) -> list:
    from tqdm import tqdm

    from tmax_jax.errors import ConfigError

    steps = tqdm(range(args.n), desc="generate", file=sys.stderr, disable=not sys.stderr.isatty())
    if args.generator == "procedural":
        from tmax_jax.tasks.generator import ProceduralGenerator

        gen = ProceduralGenerator(sampler)
        return [gen.generate_one(args.out, args.seed, i, args.format) for i in steps]
    from tmax_jax.tasks.generator.llm import Drop, LLMGenerator

    if not args.llm_url:
        raise ConfigError("--generator llm needs --llm-url")
    if args.format != "tmax":
        raise ConfigError("--generator llm writes the TMAX format only")
    llm = LLMGenerator(args.llm_url, args.model, sampler, retries=args.retries, max_tokens=args.max_tokens)
    made = []
    for i in steps:
        got = llm.generate_one(args.out, args.seed, i)
        if isinstance(got, Drop):
            report["tasks"].append(
                {"path": None, "index": i, "family": "llm", "kept": False, "reason": got.reason}
            )
        else:
            made.append(_Made(got.path, "llm", got.signature))
    return made


def run(args) -> int:
    from tqdm import tqdm

    from tmax_jax.errors import ConfigError
    from tmax_jax.sandbox import SandboxConfig
    from tmax_jax.tasks.axes import AXES_FILE, AxisSampler
    from tmax_jax.tasks.filter import filter_tasks

    if args.n < 1:
        raise ConfigError(f"--n must be >= 1, got {args.n}")
    if args.out.exists() and any(args.out.iterdir()):
        raise ConfigError(f"--out {args.out} exists and is not empty")
    args.out.mkdir(parents=True, exist_ok=True)
    sampler = AxisSampler.from_yaml(args.axes or AXES_FILE, args.corpus_kind)
    report = {"n": args.n, "seed": args.seed, "generator": args.generator, "corpus_kind": args.corpus_kind}
    report.update({"format": args.format, "tasks": []})
    t0 = time.monotonic()
    made = _draw(args, sampler, report)
    t_gen = time.monotonic() - t0
    if args.no_filter:
        kept = made
        report["tasks"] += [
            {"path": m.path.name, "family": m.family, "kept": True, "reason": "not filtered"} for m in made
        ]
    else:
        bar = tqdm(total=len(made), desc="filter", file=sys.stderr, disable=not sys.stderr.isatty())
        cfg = SandboxConfig(backend=args.backend)
        results = filter_tasks(
            [m.path for m in made], cfg, args.concurrency or None, progress=lambda r: bar.update()
        )
        bar.close()
        kept = []
        for m, r in zip(made, results):
            row = {k: v for k, v in r.to_json().items() if k != "path"}
            report["tasks"].append({"path": m.path.name, "family": m.family, **row})
            if r.kept:
                kept.append(m)
            else:
                shutil.rmtree(m.path, ignore_errors=True)
    if args.decontaminate:
        from tmax_jax.tasks.decontam import find_contaminated

        hits = {h.path.name: h for h in find_contaminated(args.out, args.decontaminate)}
        for t in report["tasks"]:
            if t["kept"] and t["path"] in hits:
                t["kept"], t["reason"] = (
                    False,
                    f"13-gram overlap with the benchmark: '{hits[t['path']].example}'",
                )
                shutil.rmtree(args.out / t["path"], ignore_errors=True)
        kept = [m for m in kept if m.path.name not in hits]
    elapsed = time.monotonic() - t0
    report.update({"kept": len(kept), "generate_s": t_gen, "total_s": elapsed})
    (args.out / "generation_report.json").write_text(json.dumps(report, indent=2) + "\n")
    fams = collections.Counter(m.family for m in kept)
    doms = collections.Counter(m.signature["domain"] for m in kept)
    print(
        f"{len(kept)}/{args.n} tasks kept in {args.out} ({elapsed:.1f}s, {60 * args.n / max(elapsed, 1e-9):.1f} tasks/min)"
    )
    print("families: " + ", ".join(f"{k} {v}" for k, v in sorted(fams.items())))
    print("domains:  " + ", ".join(f"{k} {v}" for k, v in sorted(doms.items())))
    for t in [t for t in report["tasks"] if not t["kept"]][:10]:
        print(f"dropped {t['path'] or t.get('index')}: {t['reason'][:150]}")
    return 0
