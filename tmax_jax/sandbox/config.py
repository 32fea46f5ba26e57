"""Sandbox configuration and the result of one command."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tmax_jax.errors import ConfigError

Backend = Literal["bwrap", "podman", "apptainer"]
VERIFIER_MODES = ("strict", "harbor")

# Directories every bwrap sandbox starts with (empty unless a layer fills them). The sandbox's root is
# writable everywhere outside its read-only base (/usr, /etc, ...), as a container's is.
DEFAULT_WRITABLE = (
    "/app",
    "/root",
    "/home",
    "/srv",
    "/data",
    "/opt",
    "/workspace",
    "/output",
    "/logs",
    "/tests",
    "/solution",
    "/fixtures",
    "/var/tmp",
)


# Bounds of SandboxConfig's values (task limits are checked against the same ones).
MIN_CPUS = 0.01  # the kernel's smallest CFS quota: 1 ms per 100 ms period
MAX_CPUS = 256.0
MAX_TIMEOUT_S = 30 * 86400.0
MAX_MEMORY_MB = 1 << 20  # 1 TiB
MAX_DISK_MB = 1 << 24  # 16 TiB
MAX_PIDS = 1 << 22  # the kernel's largest pid_max
MAX_NOFILE = 1 << 20  # the default fs.nr_open: setrlimit refuses more
_FLOAT_BOUNDS = {  # name: (smallest allowed, or None for "> 0"; largest allowed)
    "exec_timeout_s": (None, MAX_TIMEOUT_S),
    "episode_timeout_s": (None, MAX_TIMEOUT_S),
    "cpus": (MIN_CPUS, MAX_CPUS),
}
_INT_BOUNDS = {
    "max_output_bytes": (1, 1 << 40),
    "pids_max": (1, MAX_PIDS),
    "memory_mb": (1, MAX_MEMORY_MB),
    "disk_mb": (1, MAX_DISK_MB),
    "nofile": (1, MAX_NOFILE),
}


def default_cache_dir() -> str:
    return os.environ.get("TMAX_JAX_CACHE", str(Path.home() / ".cache" / "tmax-jax"))


@dataclass(frozen=True)
class SandboxConfig:
    """How to start a sandbox. All limits are per sandbox.

    backend: ``bwrap`` (default; read-only rootfs), ``podman`` or ``apptainer``.
    rootfs: for bwrap, ``"host"`` (the host's /usr and /etc, read-only) or a rootfs directory, e.g. one
      made by ``sandboxes/build_rootfs.py``.
    exec_timeout_s: default wall time of one ``exec``/``shell().run`` (callers may pass their own).
    episode_timeout_s: wall time of the whole sandbox life; after it every call raises
      ``EpisodeTimeout`` and the pool kills the sandbox.
    max_output_bytes: stdout+stderr kept per command; the rest is cut, the command killed, and a
      truncation marker appended.
    pids_max: processes+threads (pids cgroup when available; RLIMIT_NPROC otherwise; root is exempt
      from RLIMIT_NPROC, so without cgroups a fork bomb is stopped only by the time limits).
    memory_mb: memory cgroup limit (RLIMIT_AS when there are no cgroups).
    disk_mb: size of /tmp's tmpfs and of the writable state (a size-limited tmpfs as root,
      RLIMIT_FSIZE per file always).
    cpus: CPU share (CFS quota), e.g. 1.0 = one core; in [0.01, 256] (0.01 = the kernel's smallest
      quota, 1 ms per 100 ms).
    network: False = no network namespace link at all (loopback only).
    verifier_mode: what the verifier shares with the agent's processes (sandboxes/README.md).
      ``strict`` (the default; ``train`` and ``run-task``): the agent's processes are stopped before
      the tests run, and the verifier has a network namespace of its own (loopback only, or its own
      link when ``network``), so nothing the agent left can answer for a helper the tests start.
      ``harbor`` (``eval``'s default, as under Harbor/Docker): agent processes keep running and the
      verifier joins the agent's network, so services the agent started answer the tests. In both,
      the verifier's ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are size-limited tmpfs of its own.

    Timeouts are finite, > 0 and at most 30 days; sizes and counts are positive integers with the
    upper bounds in ``_INT_BOUNDS``. A bad value is a ConfigError naming the field.
    """

    backend: Backend = "bwrap"
    rootfs: str = "host"
    cache_dir: str = dataclasses.field(default_factory=default_cache_dir)
    run_dir: str = ""  # where per-sandbox state dirs live; "" = <cache_dir>/run
    writable_paths: tuple[str, ...] = DEFAULT_WRITABLE
    workdir: str = "/app"
    exec_timeout_s: float = 120.0
    episode_timeout_s: float = 3600.0
    max_output_bytes: int = 1 << 20
    pids_max: int = 512
    memory_mb: int = 2048
    disk_mb: int = 2048
    cpus: float = 1.0
    nofile: int = 20000
    network: bool = False
    verifier_mode: str = "strict"
    use_cgroups: bool = True
    # podman
    podman_runtime: str = "runc"
    podman_read_only: bool = False
    # apptainer
    apptainer_bin: str = "apptainer"
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.backend not in ("bwrap", "podman", "apptainer"):
            raise ConfigError(f"sandbox.backend: {self.backend!r} is not one of bwrap, podman, apptainer")
        if self.verifier_mode not in VERIFIER_MODES:
            raise ConfigError(
                f"sandbox.verifier_mode: {self.verifier_mode!r} is not one of {', '.join(VERIFIER_MODES)}"
            )
        for name, (lo, hi) in _FLOAT_BOUNDS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ConfigError(f"sandbox.{name} must be a number, got {v!r}")
            # An infinite or nan timeout never fires (nan compares False with everything).
            if not math.isfinite(v) or (v <= 0 if lo is None else v < lo) or v > hi:
                low = "> 0" if lo is None else f">= {lo:.15g}"
                raise ConfigError(
                    f"sandbox.{name} must be a finite number {low} and <= {hi:.15g}, got {v:.15g}"
                )
        for name, (lo, hi) in _INT_BOUNDS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # numpy ints are fine
                raise ConfigError(f"sandbox.{name} must be an integer, got {v!r}")
            if not lo <= v <= hi:
                raise ConfigError(f"sandbox.{name} must be in [{lo}, {hi}], got {v}")
        for p in self.writable_paths:
            if not p.startswith("/") or p.count("/") < 1 or p in ("/", "/usr", "/etc", "/proc", "/dev"):
                raise ConfigError(f"sandbox.writable_paths: {p!r} is not an allowed absolute path")

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path(self.cache_dir) / "run"


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command. ``exit_code`` is 124 on timeout, 137 when killed for flooding."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def output(self) -> str:
        """stdout then stderr, what a terminal would show."""
        if self.stderr:
            return self.stdout + ("" if not self.stdout or self.stdout.endswith("\n") else "\n") + self.stderr
        return self.stdout
