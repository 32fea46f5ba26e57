"""Evaluate an agent on every Harbor task of a directory: k attempts each, resumable, with reports.

Output layout under ``out_dir``::

    run.json                  what the attempts are comparable by (agent, model, task set, ...)
    results.jsonl             one line per finished attempt: the resume log
    summary.json, report.html pass@1 / pass@k overall and per category, per-task rows
    tasks/<task_id>/attempt-<i>/commands.jsonl   every shell command of the agent and its output
                               verifier.log, trajectory.json, error.txt (when the attempt crashed)
                               verifier/   every file the verifier wrote under /logs/verifier
                                           (reward.txt, ctrf.json, its own logs)

Attempts run on a thread pool of ``concurrency`` workers; each holds one sandbox at a time (the task
runner starts and closes it), so ``concurrency`` bounds the live sandboxes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import shutil
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tmax_jax.errors import ConfigError
from tmax_jax.eval.agents import Agent, RecordingShell
from tmax_jax.eval.html_report import render_html
from tmax_jax.eval.results import AttemptRecord, ResultsLog, check_run_identity
from tmax_jax.eval.summary import summarize
from tmax_jax.eval.tasks import EvalTask, find_eval_tasks

AgentFn = Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class AttemptOutcome:
    """What the task runner reports for one attempt."""

    reward: float
    passed: bool
    reason: str = ""
    duration_s: float = 0.0
    verifier_log: str = ""
    verifier_files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)


AttemptFn = Callable[[EvalTask, AgentFn], AttemptOutcome]
BUILD_FAILED = "environment build failed"  # the task runner's reason prefix when no image could be built


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    k: int = 1
    concurrency: int = 1
    network: bool = False  # whether environment builds can reach the internet
    retry_errors: bool = False  # re-run attempts that crashed (status "error") on resume

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"eval: k (attempts per task) must be >= 1, got {self.k}")
        if self.concurrency < 1:
            raise ConfigError(f"eval: concurrency must be >= 1, got {self.concurrency}")


def harbor_attempt(
    task: EvalTask, agent_fn: AgentFn, *, sandbox_cfg: Any = None, pool: Any = None
) -> AttemptOutcome:
    """One attempt through the task runner: build the environment, run the agent, run the verifier."""
    from tmax_jax.tasks.runner import run_task

    res = run_task(task.task, agent_fn, sandbox_cfg, pool=pool)
    return AttemptOutcome(
        reward=float(res.reward),
        passed=bool(res.passed),
        reason=str(res.reason or ""),
        duration_s=float(res.duration_s or 0.0),
        verifier_log=str(res.verifier_log or ""),
        verifier_files=dict(getattr(res, "verifier_files", None) or {}),
    )


def _jsonable(obj: Any) -> Any:
    if obj is None or isinstance(obj, (str, int, float, bool, list, dict)):
        return obj
    for attr in ("to_dict", "to_json_dict", "as_dict"):
        fn = getattr(obj, attr, None)
        if callable(fn):
            return fn()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return repr(obj)


def _keep_verifier_files(dest: Path, files: Mapping[str, bytes]) -> None:
    """Write the verifier's /logs/verifier files (subdirectories too) under ``dest`` (a rerun
    replaces the old ones).

    Names come from inside the sandbox: only relative paths of plain names are written, never one
    that could leave ``dest``."""
    if dest.is_dir():
        shutil.rmtree(dest)
    for name, data in files.items():
        parts = name.split("/")
        if not name or "\0" in name or any(p in ("", ".", "..") for p in parts):
            continue
        target = dest.joinpath(*parts)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(bytes(data))
        except OSError:
            continue  # a name that is both a file and a dir in one listing cannot happen; be safe


def attempt_dir(out_dir: Path, task_id: str, attempt: int) -> Path:
    return out_dir / "tasks" / task_id / f"attempt-{attempt}"


def _run_one(
    task: EvalTask, attempt: int, agent: Agent, out_dir: Path, run_attempt: AttemptFn
) -> AttemptRecord:
    adir = attempt_dir(out_dir, task.task_id, attempt)
    adir.mkdir(parents=True, exist_ok=True)
    commands = adir / "commands.jsonl"
    commands.unlink(missing_ok=True)  # a rerun of an interrupted attempt starts a fresh transcript
    returned: list[Any] = []

    def agent_fn(loaded_task: Any, shell: Any) -> None:
        returned.append(agent(loaded_task, RecordingShell(shell, commands)))

    rel = adir.relative_to(out_dir).as_posix()
    t0 = time.monotonic()
    try:
        outcome = run_attempt(task, agent_fn)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 - one crashed attempt must not end the run
        (adir / "error.txt").write_text(traceback.format_exc())
        return AttemptRecord(
            task.task_id,
            attempt,
            "error",
            category=task.category,
            reason=f"{type(e).__name__}: {e}"[:2000],
            duration_s=time.monotonic() - t0,
            log=rel,
        )
    (adir / "verifier.log").write_text(outcome.verifier_log)
    _keep_verifier_files(adir / "verifier", outcome.verifier_files)
    if outcome.reason.startswith(BUILD_FAILED):
        # The image could not be built here (a missing base rootfs, a step needing a tool this host
        # lacks): the model never ran, so this is not a failed attempt.
        return AttemptRecord(
            task.task_id,
            attempt,
            "env_unavailable",
            category=task.category,
            reason=outcome.reason[:2000],
            log=rel,
        )
    traj = ""
    if returned and returned[0] is not None:
        (adir / "trajectory.json").write_text(json.dumps(_jsonable(returned[0]), default=repr))
        traj = f"{rel}/trajectory.json"
    return AttemptRecord(
        task.task_id,
        attempt,
        "passed" if outcome.passed else "failed",
        reward=outcome.reward,
        category=task.category,
        reason=outcome.reason[:2000],
        duration_s=outcome.duration_s or (time.monotonic() - t0),
        log=rel,
        trajectory=traj,
    )


def evaluate(
    tasks_dir: str | Path,
    agent: Agent,
    out_dir: str | Path,
    cfg: EvalConfig = EvalConfig(),
    *,
    sandbox_cfg: Any = None,
    run_attempt: AttemptFn | None = None,
    identity: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run ``cfg.k`` attempts of ``agent`` on every task under ``tasks_dir``; returns the summary.

    Attempts already in ``out_dir``'s results log are not re-run. ``identity`` adds what makes
    results comparable (model, checkpoint, harness) to the resume check. ``sandbox_cfg`` is the
    task runner's SandboxConfig (backend, rootfs, verifier_mode; None: the default one with Harbor's
    verifier semantics); ``run_attempt`` replaces the task runner.
    """
    out_dir = Path(out_dir)
    backend = getattr(sandbox_cfg, "backend", None) or "bwrap"
    tasks = find_eval_tasks(tasks_dir, network=cfg.network, backend=backend)
    # Harbor's verifier semantics unless the config says otherwise (scores comparable with
    # published numbers); another mode is part of what makes results comparable.
    mode = getattr(sandbox_cfg, "verifier_mode", "harbor")
    ident = {
        "agent": agent.name,
        "tasks_dir": str(Path(tasks_dir).resolve()),
        "network": cfg.network,
        **({"verifier_mode": mode} if mode != "harbor" else {}),
        **dict(identity or {}),
    }
    check_run_identity(out_dir, ident)
    results = ResultsLog(out_dir, retry_errors=cfg.retry_errors)

    for t in tasks:
        if not t.environment.available and not results.is_done(t.task_id, 0):
            status = "invalid" if t.invalid else "env_unavailable"
            results.add(AttemptRecord(t.task_id, 0, status, category=t.category, reason=t.environment.reason))
            if t.invalid:
                log(f"eval: {t.task_id}: invalid task, not run: {t.invalid[:300]}")
    runnable = [t for t in tasks if t.environment.available]
    # Attempt-major order: an interrupted run has pass@1 over every task before any pass@k.
    pending = [(t, a) for a in range(cfg.k) for t in runnable if not results.is_done(t.task_id, a)]
    skipped = len(runnable) * cfg.k - len(pending)
    n_invalid = sum(bool(t.invalid) for t in tasks)
    log(
        f"eval: {len(tasks)} tasks ({len(tasks) - len(runnable) - n_invalid} environment unavailable, "
        f"{n_invalid} invalid), k={cfg.k}: "
        f"{len(pending)} attempts to run, {skipped} already done, concurrency {cfg.concurrency}"
    )
    t0 = time.monotonic()
    done = 0
    spool = None
    if run_attempt is None:
        from tmax_jax.sandbox import SandboxConfig, SandboxPool

        # The pool bounds live sandboxes to the concurrency, records their metrics and, on an
        # exception or Ctrl-C, kills them so in-flight attempts end at once (and are re-run on resume).
        spool = SandboxPool(sandbox_cfg or SandboxConfig(verifier_mode="harbor"), size=cfg.concurrency)
        run_attempt = functools.partial(harbor_attempt, sandbox_cfg=sandbox_cfg, pool=spool)
    with (
        concurrent.futures.ThreadPoolExecutor(
            max_workers=cfg.concurrency, thread_name_prefix="eval"
        ) as workers,
        spool if spool is not None else contextlib.nullcontext(),
    ):
        futures = {workers.submit(_run_one, t, a, agent, out_dir, run_attempt): (t, a) for t, a in pending}
        try:
            for fut in concurrent.futures.as_completed(futures):
                rec = fut.result()
                results.add(rec)
                done += 1
                note = (
                    f" ({rec.reason[:120]})" if rec.status in ("error", "env_unavailable", "invalid") else ""
                )
                log(
                    f"[{done}/{len(pending)}] {rec.task_id} #{rec.attempt}: {rec.status} "
                    f"reward {rec.reward:.2f} in {rec.duration_s:.1f}s{note}"
                )
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    elapsed = time.monotonic() - t0
    summary = summarize(
        results.records(),
        {t.task_id: t.category for t in tasks},
        cfg.k,
        meta={**ident, "attempts_run": done, "attempts_skipped": skipped, "elapsed_s": round(elapsed, 3)},
    )
    if spool is not None:
        # NaN (no samples) is not JSON: report it as null.
        summary["sandbox_pool"] = {
            k: (None if isinstance(v, float) and v != v else v) for k, v in spool.metrics.summary().items()
        }
    for row in summary["tasks"]:
        row["log_dir"] = f"tasks/{row['task_id']}"
    write_reports(out_dir, summary)
    return summary


def write_reports(out_dir: str | Path, summary: Mapping[str, Any]) -> None:
    out_dir = Path(out_dir)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    (out_dir / "report.html").write_text(render_html(summary))
