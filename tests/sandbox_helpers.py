"""Shared helpers for the sandbox/task tests: leak checks by scanning /proc and the run dirs."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path


def pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def procs_in_ns(ns: str) -> list[int]:
    """Host pids of every live process whose pid namespace is ``ns``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and pid_ns(int(name)) == ns:
            try:
                state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                out.append(int(name))
    return out


def procs_left_in_ns(ns: str, wait_s: float = 5.0) -> list[int]:
    """``procs_in_ns`` once the kernel has had ``wait_s`` to finish killing them: when pid 1 of a
    namespace dies, the others get SIGKILL, and on a loaded host they may take a moment to exit."""
    deadline = time.monotonic() + wait_s
    while (left := procs_in_ns(ns)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def sandbox_leftovers(cache_dir: str) -> list[str]:
    """What this process's bwrap sandboxes left behind: processes naming the cache dir or one of
    this process's stage dirs (``/run/tmax-jax/<pid>-...``, as root), and such stage dirs."""
    from tmax_jax.sandbox.bwrap import STAGE_ROOT

    ours = f"{STAGE_ROOT}/{os.getpid()}-"
    out = [f"process {p}" for p in procs_with_cmdline(cache_dir) + procs_with_cmdline(ours)]
    if STAGE_ROOT.is_dir():
        out += [f"stage {d}" for d in STAGE_ROOT.iterdir() if str(d).startswith(ours)]
    return out


def procs_with_cmdline(fragment: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fragment in cmd:
            out.append(int(name))
    return out


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every live process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] != b"Z":  # a zombie has exited already
            table[int(name)] = (int(fields[1]), int(fields[19]))
    return table


def alive(pid: int, start: int) -> bool:
    """The process ``pid`` started at ``start`` still exists (not a later process given the same pid)."""
    entry = _proc_table().get(pid)
    return entry is not None and entry[1] == start


class DescendantWatcher(threading.Thread):
    """Records every descendant of ``pid`` (sandboxes start their own sessions, but stay its children
    until it dies) until ``stop()``: {(pid, start ticks): command line}."""

    def __init__(self, pid: int, interval_s: float = 0.1):
        super().__init__(daemon=True)
        self.root, self.interval_s = pid, interval_s
        self.seen: dict[tuple[int, int], str] = {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            table = _proc_table()
            children: dict[int, list[int]] = {}
            for pid, (ppid, _) in table.items():
                children.setdefault(ppid, []).append(pid)
            stack = [self.root]
            while stack:
                for child in children.get(stack.pop(), []):
                    key = (child, table[child][1])
                    if key not in self.seen:
                        try:
                            raw = Path(f"/proc/{child}/cmdline").read_bytes()
                        except OSError:
                            raw = b""
                        self.seen[key] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
                    stack.append(child)
            self._done.wait(self.interval_s)

    def stop(self) -> None:
        self._done.set()
        self.join()

    def sandboxes(self) -> set[str]:
        """Ids of the bubblewrap sandboxes seen (from the paths of their disks and staged mounts)."""
        return {
            m
            for cmd in self.seen.values()
            if cmd.startswith("bwrap ") or " bwrap " in cmd
            for m in re.findall(r"/(\d+-[0-9a-f]{10})/(?:disk|src\d+)\b", cmd)
        }

    def still_running(self) -> list[str]:
        return [f"{pid}: {cmd}" for (pid, start), cmd in self.seen.items() if alive(pid, start)]
