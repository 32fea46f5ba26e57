"""The task a runner executes, whatever directory layout it came from."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tmax_jax.errors import TaskFormatError


@dataclass(frozen=True)
class TaskLimits:
    agent_timeout_s: float = 900.0
    verifier_timeout_s: float = 600.0
    build_timeout_s: float = 600.0
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 4096
    allow_internet: bool = False


@dataclass(frozen=True)
class EnvironmentSpec:
    """How to build the task's environment.

    kind: ``dockerfile`` (Harbor environment/Dockerfile), ``image`` (a prebuilt image name),
    ``apptainer_def`` (TMAX container.def) or ``base`` (nothing but the default rootfs).
    setup_script / fixtures_dir: TMAX ``setup.sh`` and ``fixtures/``, run after the recipe.
    """

    kind: Literal["dockerfile", "image", "apptainer_def", "base"]
    path: Path | None = None
    image: str | None = None
    setup_script: Path | None = None
    fixtures_dir: Path | None = None


@dataclass(frozen=True)
class Task:
    """A Harbor or TMAX task. ``tests_dir`` is copied to /tests only after the agent is done."""

    name: str
    path: Path
    format: Literal["harbor", "tmax"]
    instruction: str
    limits: TaskLimits
    environment: EnvironmentSpec
    tests_dir: Path | None = None  # harbor: tests/ (with test.sh)
    final_test: Path | None = None  # tmax: test_final_state.py
    initial_test: Path | None = None  # tmax: test_initial_state.py
    solution: Path | None = None  # the oracle script (solution/solve.sh or solutions/solve.sh)
    metadata: dict[str, Any] = field(default_factory=dict)
    signature: dict[str, Any] = field(default_factory=dict)  # tmax: sampled axes

    @property
    def prompt(self) -> str:
        return self.instruction


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.I)


def parse_size_mb(value: Any, where: str) -> int:
    """'2G', '512M', '1.5GiB', 2048 (MB) -> MB."""
    if isinstance(value, bool):
        raise TaskFormatError(f"{where}: expected a size like '2G' or a number of MB, got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise TaskFormatError(f"{where}: size must be > 0, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise TaskFormatError(f"{where}: expected a size like '2G', got {type(value).__name__}")
    m = _SIZE.match(value)
    if not m:
        raise TaskFormatError(f"{where}: cannot read size {value!r} (use e.g. '2G', '512M')")
    num, unit = float(m.group(1)), (m.group(2) or "m").lower()[0]
    mult = {"b": 1 / (1 << 20), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1 << 20}[unit]
    mb = int(num * mult)
    if mb <= 0:
        raise TaskFormatError(f"{where}: size {value!r} is below 1 MB")
    return mb


def number(value: Any, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise TaskFormatError(f"{where}: expected a number, got {value!r}") from None
        else:
            raise TaskFormatError(f"{where}: expected a number, got {value!r}")
    if positive and value <= 0:
        raise TaskFormatError(f"{where}: must be > 0, got {value}")
    return float(value)


def boolean(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
        return value.lower() in ("true", "yes")
    raise TaskFormatError(f"{where}: expected true/false, got {value!r}")
