"""Shared helpers for the sandbox/task tests: leak checks by scanning /proc and the run dirs."""

from __future__ import annotations

import os
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
