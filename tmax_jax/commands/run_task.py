"""``tmax-jax run-task TASK_DIR`` and ``tmax-jax run-tasks DIR``: grade tasks in sandboxes.

run-task prepares the environment, runs the initial-state test (TMAX), the reference solution when
``--oracle`` (else nothing: the no-op baseline), then the verifier. With ``--json`` the last line
is ``{"task", "reward", "passed", "reason", "duration_s", "verifier_log", ...}``. Exit status: 0
when the task passed, 1 when it did not, 3 when it cannot run here: a task whose build, tests or
solution download from the internet (or whose task.toml allows the internet) in an offline run
(without ``--network``) is unavailable, with the line that needs the network, never scored
(``--json``: ``{"task", "status": "env_unavailable", "reason"}``).

run-tasks does every task under DIR on the sandbox pool, with a progress bar and a summary table;
unavailable tasks are listed with the reason and left out of the pass count and mean reward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--oracle", action="store_true", help="run the task's reference solution as the agent")
    p.add_argument(
        "--backend", choices=["bwrap", "podman", "apptainer"], default="bwrap", help="sandbox backend"
    )
    p.add_argument("--rootfs", default="host", help="bwrap rootfs: 'host' or a rootfs directory")
    p.add_argument("--json", action="store_true", help="print results as JSON (the last line for run-task)")
    p.add_argument(
        "--network",
        action="store_true",
        help="builds reach the internet, and so do sandboxes of tasks whose task.toml allows it",
    )
    p.add_argument(
        "--cache-dir", help="layers/images/run dirs (default ~/.cache/tmax-jax or $TMAX_JAX_CACHE)"
    )
    verifier_mode_option(p, "strict")


def verifier_mode_option(p: argparse.ArgumentParser, default: str) -> None:
    """``--verifier-mode``: what the verifier shares with the agent's processes (SandboxConfig)."""
    p.add_argument(
        "--verifier-mode",
        choices=["strict", "harbor"],
        default=default,
        help="strict: the agent's processes are stopped before the tests, which get a network of their "
        "own; harbor: services the agent left running answer the tests, as under Harbor/Docker "
        f"(default: {default})",
    )


def register(subparsers) -> None:
    p = subparsers.add_parser("run-task", help="run one Harbor/TMAX task in a sandbox and print its reward")
    p.add_argument("task_dir", type=Path, help="a Harbor (task.toml) or TMAX (task.json) task directory")
    _common(p)
    p.set_defaults(func=run, uses_jax=False)
    q = subparsers.add_parser("run-tasks", help="run every task under a directory on the sandbox pool")
    q.add_argument("dir", type=Path, help="directory searched for task dirs")
    q.add_argument("--concurrency", type=int, default=0, help="sandboxes at once (default: CPU count)")
    _common(q)
    q.set_defaults(func=run_many, uses_jax=False)


def _config(args):
    from tmax_jax.sandbox import SandboxConfig

    kw = {
        "backend": args.backend,
        "rootfs": args.rootfs,
        "network": bool(getattr(args, "network", False)),
        "verifier_mode": getattr(args, "verifier_mode", "strict"),
    }
    if args.cache_dir:
        kw["cache_dir"] = args.cache_dir
    return SandboxConfig(**kw)


def run(args) -> int:
    from tmax_jax.errors import TmaxError
    from tmax_jax.tasks import load_task
    from tmax_jax.tasks.runner import TaskResult, run_task

    try:
        task = load_task(args.task_dir)
    except TmaxError as e:
        if not Path(args.task_dir).is_dir():
            raise
        # A task that is there but malformed is scored, not crashed on: --json gets a result line.
        res = TaskResult(Path(args.task_dir).name, 0.0, False, f"bad task: {e}", 0.0)
    else:
        why = _unavailable(task, args)
        if why is not None:
            if args.json:
                print(json.dumps({"task": task.path.name, "status": "env_unavailable", "reason": why}))
            else:
                print(f"{task.path.name}: unavailable here ({why})")
            return 3
        res = run_task(task, "oracle" if args.oracle else None, _config(args))
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        print(
            f"{res.task}: reward {res.reward:g} ({'passed' if res.passed else 'failed'}: {res.reason}) in {res.duration_s:.2f}s"
        )
    return 0 if res.passed else 1


def _unavailable(task, args) -> str | None:
    from tmax_jax.eval.environment import task_availability

    env = task_availability(task, network=bool(getattr(args, "network", False)), backend=args.backend)
    return None if env.available else env.reason


def run_many(args) -> int:
    from tqdm import tqdm

    from tmax_jax.errors import TmaxError
    from tmax_jax.sandbox import SandboxPool
    from tmax_jax.tasks import find_tasks, load_task
    from tmax_jax.tasks.runner import TaskResult, run_task

    cfg = _config(args)
    dirs = find_tasks(args.dir)
    agent = "oracle" if args.oracle else None
    results: list[TaskResult] = []

    unavailable: list[tuple[str, str]] = []
    runnable = []
    for d in dirs:
        try:
            why = _unavailable(load_task(d), args)
        except TmaxError:
            why = None  # reported as a bad task by the run
        if why is None:
            runnable.append(d)
        else:
            unavailable.append((d.name, why))

    def one(d: Path) -> TaskResult:
        try:
            task = load_task(d)
        except TmaxError as e:
            return TaskResult(d.name, 0.0, False, f"bad task: {e}", 0.0)
        return run_task(task, agent, cfg, pool=pool)

    with SandboxPool(cfg, size=args.concurrency or None) as pool:
        futs = [pool.submit(one, d) for d in runnable]
        for f in tqdm(futs, desc="tasks", unit="task", file=sys.stderr, disable=not sys.stderr.isatty()):
            results.append(f.result())
        metrics = pool.metrics.summary()
    if args.json:
        for r in results:
            print(json.dumps(r.to_json()))
        for name, why in unavailable:
            print(json.dumps({"task": name, "status": "env_unavailable", "reason": why}))
        summary = {**_summary(results), "env_unavailable": len(unavailable)}
        print(json.dumps({"summary": summary, "pool": metrics}))
    else:
        _table(results, metrics)
        for name, why in unavailable:
            print(f"unavailable here: {name}: {why}")
    return 0


def _summary(results) -> dict:
    n = len(results)
    return {
        "tasks": n,
        "passed": sum(r.passed for r in results),
        "mean_reward": sum(r.reward for r in results) / n if n else 0.0,
    }


def _table(results, metrics) -> None:
    w = max([len(r.task) for r in results] + [4])
    print(f"{'task':<{w}}  reward  passed  time_s  reason")
    for r in results:
        print(f"{r.task:<{w}}  {r.reward:6.3f}  {str(r.passed):<6}  {r.duration_s:6.2f}  {r.reason[:80]}")
    s = _summary(results)
    print(f"\n{s['passed']}/{s['tasks']} passed, mean reward {s['mean_reward']:.3f}")
    print(
        f"sandbox start p50 {metrics['start_p50_s'] * 1e3:.0f} ms, exec p50 {metrics['exec_p50_s'] * 1e3:.0f} ms, "
        f"failures {metrics['failures'] or 'none'}"
    )
