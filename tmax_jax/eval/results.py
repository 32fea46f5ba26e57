"""The results log of an evaluation run: one JSON line per finished attempt, the basis of resume.

An attempt is written only after it finished (reward known, or the environment judged unavailable),
with a flush and fsync, so a run killed at any moment leaves a log whose every line is a complete
attempt; a torn last line from a crash mid-write is ignored on reload. Re-running the same command
skips every ``(task_id, attempt)`` already in the log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from tmax_jax.errors import ConfigError

# env_unavailable: the task cannot run here (no network, a build step this backend cannot honour);
# invalid: the task dir itself is malformed. Neither is scored.
Status = Literal["passed", "failed", "error", "env_unavailable", "invalid"]
STATUSES: tuple[str, ...] = ("passed", "failed", "error", "env_unavailable", "invalid")
UNSCORED: tuple[str, ...] = ("env_unavailable", "invalid")
RESULTS_FILE = "results.jsonl"
RUN_FILE = "run.json"


@dataclasses.dataclass(frozen=True)
class AttemptRecord:
    task_id: str
    attempt: int
    status: Status
    reward: float = 0.0
    category: str = "uncategorized"
    reason: str = ""
    duration_s: float = 0.0
    log: str = ""  # paths relative to the output dir
    trajectory: str = ""
    finished_at: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ConfigError(f"attempt status {self.status!r} is not one of {list(STATUSES)}")
        if self.attempt < 0:
            raise ConfigError(f"attempt index must be >= 0, got {self.attempt}")

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def key(self) -> tuple[str, int]:
        return self.task_id, self.attempt

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AttemptRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class ResultsLog:
    """Append-only, thread-safe JSONL of ``AttemptRecord``s under an output dir."""

    def __init__(self, out_dir: str | Path, *, retry_errors: bool = False):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / RESULTS_FILE
        self.retry_errors = retry_errors
        self._lock = threading.Lock()
        self._records: dict[tuple[str, int], AttemptRecord] = {}
        if self.path.is_file():
            self._load()

    def _load(self) -> None:
        lines = self.path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = AttemptRecord.from_json(json.loads(line))
            except (json.JSONDecodeError, TypeError) as e:
                if i == len(lines) - 1:
                    # A torn write of an attempt that never finished: drop it (it is simply re-run),
                    # or the next append would glue a record onto it.
                    self.path.write_text("".join(line + "\n" for line in lines[:i]))
                    break
                raise ConfigError(f"{self.path}: line {i + 1} is not an attempt record: {e}") from e
            self._records[rec.key] = rec  # later lines (retried errors) win

    def is_done(self, task_id: str, attempt: int) -> bool:
        rec = self._records.get((task_id, attempt))
        if rec is None:
            return False
        return not (self.retry_errors and rec.status == "error")

    def add(self, rec: AttemptRecord) -> None:
        if not rec.finished_at:
            rec = dataclasses.replace(rec, finished_at=time.time())
        line = json.dumps(dataclasses.asdict(rec), sort_keys=True) + "\n"
        with self._lock:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self._records[rec.key] = rec

    def records(self) -> list[AttemptRecord]:
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.key)

    def __len__(self) -> int:
        return len(self._records)


def check_run_identity(out_dir: str | Path, identity: Mapping[str, Any]) -> None:
    """Refuse to resume into an output dir that holds results of a different agent or task set.

    ``identity`` names what makes attempts comparable (agent, model, harness, tasks dir); k may grow
    between runs (extra attempts are simply added).
    """
    out_dir = Path(out_dir)
    path = out_dir / RUN_FILE
    identity = json.loads(json.dumps(dict(identity)))
    if path.is_file():
        saved = json.loads(path.read_text())
        diff = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
        if diff:
            details = "; ".join(f"{k}: saved {saved.get(k)!r}, now {identity.get(k)!r}" for k in diff)
            raise ConfigError(
                f"{out_dir} holds results of another run ({details}); use a new --out dir to compare"
            )
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(identity, indent=2, sort_keys=True))


def records_by_task(records: Iterable[AttemptRecord]) -> dict[str, list[AttemptRecord]]:
    out: dict[str, list[AttemptRecord]] = {}
    for r in records:
        out.setdefault(r.task_id, []).append(r)
    return out
