"""``load_task``: a Harbor or TMAX directory -> Task; ``find_tasks``: every task under a directory."""

from __future__ import annotations

from pathlib import Path

from tmax_jax.errors import TaskFormatError
from tmax_jax.tasks.harbor import is_harbor, load_harbor
from tmax_jax.tasks.model import Task
from tmax_jax.tasks.tmax_format import is_tmax, load_tmax


def load_task(path: str | Path) -> Task:
    path = Path(path)
    if not path.is_dir():
        raise TaskFormatError(f"task directory not found: {path}")
    if is_tmax(path):
        return load_tmax(path)
    if is_harbor(path):
        return load_harbor(path)
    raise TaskFormatError(
        f"{path}: neither a TMAX task (task.json) nor a Harbor task (task.toml + instruction.md)"
    )


def is_task_dir(path: Path) -> bool:
    return path.is_dir() and (is_tmax(path) or is_harbor(path))


def find_tasks(root: str | Path) -> list[Path]:
    """Task dirs at or below ``root`` (a task dir's own subdirs are not searched)."""
    root = Path(root)
    if not root.is_dir():
        raise TaskFormatError(f"task directory not found: {root}")
    if is_task_dir(root):
        return [root]
    out = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and not child.name.startswith("."):
            out.extend(find_tasks(child))
    return out
