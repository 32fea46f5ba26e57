"""Run a study's variants x seeds, one ``tmax-jax train`` process each, resumably.

A run is finished when its run dir holds ``summary.json`` (and, with a study eval, its eval's
summary): a finished run is never rerun. An unfinished one is started again with the same command,
and ``tmax-jax train`` resumes it from its last checkpoint. Each run's output goes to
``OUT/logs/<run>.log``; ``RUN_DIR/study_run.json`` records its command, exit status and wall time
(summed over attempts).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tmax_jax.errors import TmaxError
from tmax_jax.study.spec import Study, yaml_value


class StudyInterrupted(TmaxError):
    """The study was stopped (Ctrl-C or a run interrupted); running it again picks up from here."""


def train_argv(study: Study, variant: str, seed: int) -> list[str]:
    """``tmax-jax train`` arguments of one run (without the program name)."""
    out = ["train", str(study.base), "--no-progress"]
    for key, value in study.overrides(variant, seed).items():
        out += ["--set", f"{key}={yaml_value(value)}"]
    return out


def eval_argvs(study: Study, variant: str, seed: int) -> list[list[str]]:
    """The export and eval commands of one run's study eval (none without ``eval``)."""
    if study.eval is None:
        return []
    run = study.run_dir(variant, seed)
    hf = run / "study_hf"
    e = study.eval
    return [
        ["export-hf", str(run), "--out", str(hf)],
        ["eval", "--tasks", str(e.tasks), "--checkpoint", str(hf), "-k", str(e.k)]
        + ["--concurrency", str(e.concurrency), "--out", str(run / "study_eval")],
    ]


def commands(study: Study) -> list[str]:
    """Every run's commands as shell lines, in study order: what a launcher can spread over hosts."""
    lines = []
    for variant, seed in study.runs():
        for argv in [train_argv(study, variant, seed), *eval_argvs(study, variant, seed)]:
            lines.append(shlex.join(["tmax-jax", *argv]))
    return lines


def finished(study: Study, variant: str, seed: int) -> bool:
    run = study.run_dir(variant, seed)
    done = (run / "summary.json").is_file()
    if study.eval is not None:
        done = done and (run / "study_eval" / "summary.json").is_file()
    return done


def _record(run: Path, argv: list[str], rc: int, wall_s: float) -> None:
    path = run / "study_run.json"
    prev = json.loads(path.read_text()) if path.is_file() else {}
    rec = {
        "command": shlex.join(["tmax-jax", *argv]),
        "exit_code": rc,
        "wall_s": float(prev.get("wall_s", 0.0)) + wall_s,
        "attempts": int(prev.get("attempts", 0)) + 1,
    }
    run.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=2) + "\n")


def _run_one(argv: list[str], log_path: Path, env: dict | None) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"\n$ tmax-jax {shlex.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen([sys.executable, "-m", "tmax_jax", *argv], stdout=log, stderr=log, env=env)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            # tmax-jax train checkpoints and exits 130 on SIGINT (it got the same Ctrl-C).
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def run_study(study: Study, *, env: dict | None = None, echo=print) -> dict[str, str]:
    """Run every unfinished (variant, seed) in turn. Returns run name -> "done" / "skipped" (finished
    before) / "failed: ..."; a failed run does not stop the others. Ctrl-C, or a run that exits 130,
    stops the study (``StudyInterrupted``)."""
    runs = study.runs()
    status: dict[str, str] = {}
    for i, (variant, seed) in enumerate(runs, 1):
        name = study.run_name(variant, seed)
        if finished(study, variant, seed):
            status[name] = "skipped"
            echo(f"[study] {i}/{len(runs)} {name}: finished before, not rerun")
            continue
        run = study.run_dir(variant, seed)
        log_path = study.out / "logs" / f"{name}.log"
        echo(f"[study] {i}/{len(runs)} {name}: running (log: {log_path})")
        t0 = time.monotonic()
        failure = None
        for argv in [train_argv(study, variant, seed), *eval_argvs(study, variant, seed)]:
            if argv[0] == "train" and (run / "summary.json").is_file():
                continue  # trained before; only its eval is missing
            t1 = time.monotonic()
            try:
                rc = _run_one(argv, log_path, env)
            except KeyboardInterrupt:
                _record(run, argv, 130, time.monotonic() - t1)
                raise StudyInterrupted(f"interrupted during {name}; run the study again to go on") from None
            if argv[0] == "train":
                _record(run, argv, rc, time.monotonic() - t1)
            if rc == 130:
                raise StudyInterrupted(f"{name} was interrupted; run the study again to go on")
            if rc != 0:
                failure = f"failed: tmax-jax {argv[0]} exited {rc} (see {log_path})"
                break
        status[name] = failure or "done"
        took = time.monotonic() - t0
        if failure:
            echo(f"[study] {i}/{len(runs)} {name}: {failure}")
        else:
            s = json.loads((run / "summary.json").read_text())
            echo(
                f"[study] {i}/{len(runs)} {name}: done in {took / 60:.1f} min, held-out pass rate "
                f"{s['pass_rate_before']:.3f} -> {s['pass_rate_after']:.3f}"
            )
    return status
