"""Per-sandbox cgroups (v2 unified, or v1 pids/memory/cpu hierarchies) for limits and sure kills.

A sandbox's processes are put in its own cgroup by a tiny host-side ``sh`` prefix that writes its pid
to ``cgroup.procs`` before ``exec``-ing the real command, so every child is born inside the group.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

from tmax_jax.errors import ConfigError

ROOT = Path("/sys/fs/cgroup")
GROUP = "tmax-jax"
V1_CONTROLLERS = ("pids", "memory", "cpu")


def _mode() -> str | None:
    if (ROOT / "cgroup.controllers").is_file():
        return "v2"
    if all((ROOT / c).is_dir() for c in V1_CONTROLLERS):
        return "v1"
    return None


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def available() -> bool:
    mode = _mode()
    if mode == "v1":
        return all(_writable(ROOT / c / GROUP) for c in V1_CONTROLLERS)
    if mode == "v2":
        controllers = (ROOT / "cgroup.controllers").read_text().split()
        if not {"pids", "memory", "cpu"} <= set(controllers) or not _writable(ROOT / GROUP):
            return False
        try:
            (ROOT / "cgroup.subtree_control").write_text("+pids +memory +cpu")
            (ROOT / GROUP / "cgroup.subtree_control").write_text("+pids +memory +cpu")
        except OSError:
            return False
        return True
    return False


CFS_PERIOD_US = 100_000
MIN_CFS_QUOTA_US = 1000  # the kernel refuses a smaller quota with EINVAL


def cfs_quota_us(cpus: float) -> int:
    """CFS quota per 100 ms period for ``cpus`` cores, floored to the kernel's 1 ms minimum (a
    ``cpus = 0.001`` task gets 0.01 of a core rather than an OSError from the kernel)."""
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not math.isfinite(cpus) or cpus <= 0:
        raise ConfigError(f"sandbox.cpus must be a finite number > 0, got {cpus!r}")
    return max(MIN_CFS_QUOTA_US, round(cpus * CFS_PERIOD_US))


class Cgroup:
    """One sandbox's cgroup; ``create`` sets the limits, ``kill_all`` + ``remove`` clean up."""

    def __init__(self, name: str):
        self.name = name
        self.mode = _mode()
        if self.mode == "v1":
            self.dirs = [ROOT / c / GROUP / name for c in V1_CONTROLLERS]
        else:
            self.dirs = [ROOT / GROUP / name]

    def create(self, *, pids_max: int, memory_mb: int, cpus: float) -> None:
        quota = str(cfs_quota_us(cpus))
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        mem = str(memory_mb << 20)
        if self.mode == "v1":
            pids, memory, cpu = self.dirs
            (pids / "pids.max").write_text(str(pids_max))
            (memory / "memory.limit_in_bytes").write_text(mem)
            try:  # swap accounting is often off; without it the plain limit still holds
                (memory / "memory.memsw.limit_in_bytes").write_text(mem)
            except OSError:
                pass
            (cpu / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(quota)
        else:
            d = self.dirs[0]
            (d / "pids.max").write_text(str(pids_max))
            (d / "memory.max").write_text(mem)
            try:
                (d / "memory.swap.max").write_text("0")
            except OSError:
                pass
            (d / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(out)

    def kill_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every member until none is left (a fork bomb keeps forking while we kill)."""
        if self.mode == "v2" and (self.dirs[0] / "cgroup.kill").exists():
            try:
                (self.dirs[0] / "cgroup.kill").write_text("1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids or time.monotonic() > deadline:
                return
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)

    def memory_peak_bytes(self) -> int | None:
        f = "memory.max_usage_in_bytes" if self.mode == "v1" else "memory.peak"
        d = self.dirs[1] if self.mode == "v1" else self.dirs[0]
        try:
            return int((d / f).read_text())
        except (OSError, ValueError):
            return None


def stale_groups() -> list[str]:
    """Names of tmax-jax cgroups (any owner) that exist now."""
    base = ROOT / "pids" / GROUP if _mode() == "v1" else ROOT / GROUP
    try:
        return sorted(p.name for p in base.iterdir() if p.is_dir())
    except OSError:
        return []
