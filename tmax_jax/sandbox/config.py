"""Sandbox configuration and the result of one command."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tmax_jax.errors import ConfigError

Backend = Literal["bwrap", "podman", "apptainer"]

# Paths that are writable inside a bwrap sandbox (bind-mounted from the sandbox's own state dir).
# Everything else comes from the read-only rootfs. Dockerfile WORKDIR/COPY targets must live here.
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
    cpus: CPU share (CFS quota), e.g. 1.0 = one core.
    network: False = no network namespace link at all (loopback only).
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
        for name in ("exec_timeout_s", "episode_timeout_s", "cpus"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"sandbox.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_output_bytes", "pids_max", "memory_mb", "disk_mb", "nofile"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"sandbox.{name} must be > 0, got {getattr(self, name)}")
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
