"""The task a runner executes, whatever directory layout it came from."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tmax_jax.errors import TaskFormatError
from tmax_jax.sandbox.config import MAX_CPUS, MAX_DISK_MB, MAX_MEMORY_MB, MIN_CPUS

# What a task may ask for. Each bound sits inside what SandboxConfig accepts, because the runner turns
# a task's limits into a SandboxConfig (episode = agent + verifier + 120 s must stay under its cap).
MAX_TIMEOUT_S = 7 * 86400.0
MIN_MEMORY_MB = 16  # below this bash itself does not start: the task could only ever score 0


@dataclass(frozen=True)
class TaskLimits:
    """Per-task limits, each validated (finite, within the bounds above) wherever it came from.

    Timeouts: seconds, in (0, 7 days]. cpus: in [0.01, 256]. memory_mb: [16 MB, 1 TiB].
    storage_mb: [1 MB, 16 TiB]. agent_services: the tests check services the agent leaves running
    (Harbor's ``[verifier] agent_services``, TMAX's ``limits.agent_services``): the task is verified
    with Harbor's semantics (``SandboxConfig.verifier_mode = "harbor"``) whatever the run's mode, so
    its tests must start no helper of their own that an agent's process could stand in for.
    """

    agent_timeout_s: float = 900.0
    verifier_timeout_s: float = 600.0
    build_timeout_s: float = 600.0
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 4096
    allow_internet: bool = False
    agent_services: bool = False

    def __post_init__(self):
        for name in ("agent_timeout_s", "verifier_timeout_s", "build_timeout_s"):
            object.__setattr__(self, name, timeout_s(getattr(self, name), f"task limits: {name}"))
        object.__setattr__(self, "cpus", cpu_count(self.cpus, "task limits: cpus"))
        object.__setattr__(self, "memory_mb", memory_mb(self.memory_mb, "task limits: memory_mb"))
        object.__setattr__(self, "storage_mb", storage_mb(self.storage_mb, "task limits: storage_mb"))
        for name in ("allow_internet", "agent_services"):
            if not isinstance(getattr(self, name), bool):
                raise TaskFormatError(f"task limits: {name} must be true/false, got {getattr(self, name)!r}")


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
    # Harbor task.toml [verifier.env], [solution.env], [agent.env]: variables set for the verifier,
    # the reference solution's shell and the agent's shell (on top of the sandbox's own).
    verifier_env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)
    agent_env: dict[str, str] = field(default_factory=dict)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.I)


def parse_size_mb(value: Any, where: str, minimum: int = 1, maximum: int | None = None) -> int:
    """'2G', '512M', '1.5GiB', 2048 (MB) -> MB, within [minimum, maximum] MB."""
    if isinstance(value, bool):
        raise TaskFormatError(f"{where}: expected a size like '2G' or a number of MB, got {value!r}")
    if isinstance(value, numbers.Real):
        # An int is always finite (and math.isfinite overflows on one with hundreds of digits).
        if not (isinstance(value, numbers.Integral) or math.isfinite(value)) or value <= 0:
            raise TaskFormatError(f"{where} must be a finite size > 0, got {value}")
        mb = int(value)
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise TaskFormatError(f"{where}: cannot read size {value!r} (use e.g. '2G', '512M')")
        num, unit = float(m.group(1)), (m.group(2) or "m").lower()[0]
        mult = {"b": 1 / (1 << 20), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1 << 20}[unit]
        if not math.isfinite(num * mult):  # hundreds of digits
            raise TaskFormatError(f"{where}: size {value[:40]!r} is too large")
        mb = int(num * mult)
    else:
        raise TaskFormatError(f"{where}: expected a size like '2G', got {type(value).__name__}")
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
    if mb < minimum:
        raise TaskFormatError(f"{where}: size {shown} is below {minimum} MB")
    if maximum is not None and mb > maximum:
        raise TaskFormatError(f"{where}: size {shown} is above the maximum of {maximum} MB")
    return mb


def number(value: Any, where: str, positive: bool = True, maximum: float | None = None) -> float:
    """A finite number (a numeric string is read too); > 0 when ``positive``; <= ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise TaskFormatError(f"{where}: expected a number, got {value!r}") from None
        else:
            raise TaskFormatError(f"{where}: expected a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an integer with hundreds of digits
        raise TaskFormatError(f"{where} must be a finite number, got {str(value)[:40]}...") from None
    # inf and nan compare False with everything: without this check `nan <= 0` lets nan through and a
    # timeout of inf or nan never fires.
    if not math.isfinite(value) or (positive and value <= 0):
        raise TaskFormatError(f"{where} must be a finite number{' > 0' if positive else ''}, got {value}")
    if maximum is not None and value > maximum:
        raise TaskFormatError(f"{where} must be at most {maximum:g}, got {value:g}")
    return value


def timeout_s(value: Any, where: str) -> float:
    return number(value, where, maximum=MAX_TIMEOUT_S)


def cpu_count(value: Any, where: str) -> float:
    cpus = number(value, where, maximum=MAX_CPUS)
    if cpus < MIN_CPUS:
        raise TaskFormatError(
            f"{where} must be at least {MIN_CPUS:g} (the kernel's smallest CPU quota is 1 ms per 100 ms), "
            f"got {cpus:g}"
        )
    return cpus


def memory_mb(value: Any, where: str) -> int:
    return parse_size_mb(value, where, minimum=MIN_MEMORY_MB, maximum=MAX_MEMORY_MB)


def storage_mb(value: Any, where: str) -> int:
    return parse_size_mb(value, where, maximum=MAX_DISK_MB)


def read_text(path: Path) -> str:
    """A task file as UTF-8 text; anything else is a TaskFormatError naming the file."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskFormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TaskFormatError(f"{path}: cannot read: {e.strerror or e}") from None


def boolean(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
        return value.lower() in ("true", "yes")
    raise TaskFormatError(f"{where}: expected true/false, got {value!r}")


def task_family(task: Task) -> str:
    """The family a task belongs to (its metadata, else "other")."""
    return str(task.metadata.get("family") or task.signature.get("family") or "other")


def task_axes(task: Task) -> dict[str, str]:
    """A task's axis values: the TMAX signature, or a Harbor task's ``axis_*`` metadata."""
    if task.signature:
        return {k: str(v) for k, v in task.signature.items()}
    return {k[5:]: str(v) for k, v in task.metadata.items() if k.startswith("axis_")}
