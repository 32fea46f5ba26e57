"""The task set of an evaluation: every Harbor task directory under a root, with its category."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tmax_jax.errors import TaskFormatError
from tmax_jax.eval.environment import EnvironmentCheck, task_availability
from tmax_jax.eval.summary import UNCATEGORIZED


@dataclasses.dataclass(frozen=True)
class EvalTask:
    task_id: str  # the task dir relative to the task-set root: unique, and stable across runs
    path: Path
    category: str  # task.toml [metadata] category
    environment: EnvironmentCheck
    task: Any  # the loaded tmax_jax.tasks.Task (None when invalid)
    invalid: str = ""  # why the task dir could not be loaded: listed as invalid, never run


def _category(task: Any) -> str:
    category = (getattr(task, "metadata", None) or {}).get("category", UNCATEGORIZED)
    if not isinstance(category, str) or not category.strip():
        raise TaskFormatError(
            f"{task.path}/task.toml: metadata.category must be a non-empty string, got {category!r}"
        )
    return category.strip()


def find_eval_tasks(root: str | Path, *, network: bool = False, backend: str = "bwrap") -> list[EvalTask]:
    """Harbor tasks under ``root`` (TMAX task.json dirs are skipped), sorted by id, each with its
    availability for a run on ``backend`` with or without the network.

    A malformed task dir is kept in the set as ``invalid`` with the reason (it is listed in the
    report, not scored) so the rest of the set still runs; a set without any Harbor task dir is a
    TaskFormatError.
    """
    from tmax_jax.tasks import find_tasks, load_task
    from tmax_jax.tasks.tmax_format import is_tmax

    root = Path(root)
    out = []
    for path in find_tasks(root):
        task_id = path.relative_to(root).as_posix() if path != root else path.name
        try:
            task = load_task(path)
            if task.format != "harbor":
                continue
            category = _category(task)
        except TaskFormatError as e:
            if is_tmax(path):
                continue  # not a Harbor task: not part of this evaluation
            why = str(e)
            out.append(
                EvalTask(task_id, path, UNCATEGORIZED, EnvironmentCheck(False, why), None, invalid=why)
            )
            continue
        out.append(
            EvalTask(task_id, path, category, task_availability(task, network=network, backend=backend), task)
        )
    if not out:
        raise TaskFormatError(f"no Harbor tasks (task.toml + instruction.md + tests/test.sh) under {root}")
    return sorted(out, key=lambda t: t.task_id)
