"""Symlinks the agent made that lead a verifier into its own files.

A verifier sees the agent's files with its own ``/tests`` (the task's tests, expected outputs among
them) and ``/logs`` mounted beside them. A link the agent made, ``/app/answer.txt ->
/tests/expected.txt``, is dangling for the agent but is the answer for the tests: reading the agent's
output, they would read their own. ``/proc/self/root/tests/...``, ``/proc/self/cwd/...`` and
``/proc/PID/fd/N`` reach the verifier's files the same way, through its processes.

``find_link_into_verifier`` walks what the agent wrote and resolves each symlink there as the
verifier's kernel would (through other links, ``..`` included; a missing component is taken
lexically, since a process the agent left running could still create it). A link that reaches
``/tests``, ``/logs``, ``/dev/fd`` or a ``/proc`` path through a process's ``root``, ``cwd``, ``fd``,
``map_files`` or ``exe`` is reported; links to ``/proc/mounts``, ``/dev/null``, ``/dev/stdout`` and the
like are not. Both backends call it before and after a verification (``run_verifier``).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence

# Places only the verifier's own files are: a path reaching one of these prefixes is reported.
VERIFIER_DIRS = (("tests",), ("logs",), ("dev", "fd"))
# /proc entries through which a process's root, working directory or open files are reached.
PROC_DOORS = frozenset({"root", "cwd", "fd", "map_files", "exe"})
MAX_HOPS = 40  # the kernel's own limit on links followed in one lookup
MAX_ENTRIES = 2_000_000

HostOf = Callable[[Sequence[str]], "str | None"]


def _verifier_place(parts: list[str]) -> bool:
    if parts and parts[0] == "proc":
        return any(p in PROC_DOORS for p in parts[1:])
    return any(tuple(parts[: len(d)]) == d for d in VERIFIER_DIRS)


def reaches_verifier(host_of: HostOf, parent: Sequence[str], target: str) -> str | None:
    """Where a link in the dir ``parent`` (path components in the sandbox's view) whose content is
    ``target`` leads, when that is a verifier's place; else None. ``host_of(parts)`` is the host path
    of a path of the sandbox's view (None where there is none to look at)."""
    cur = [] if target.startswith("/") else list(parent)
    pending = deque(target.split("/"))
    hops = 0
    while pending:
        c = pending.popleft()
        if c in ("", "."):
            continue
        if c == "..":
            if cur:
                cur.pop()
            continue
        cur.append(c)
        if _verifier_place(cur):
            return "/" + "/".join(cur)
        if cur[0] == "proc":
            continue  # procfs is the verifier's own; read lexically
        host = host_of(cur)
        if host is None:
            continue
        try:
            if not os.path.islink(host):
                continue
            link = os.readlink(host)
        except OSError:
            continue
        hops += 1
        if hops > MAX_HOPS:
            return None  # ELOOP: the verifier's open fails too
        cur.pop()
        if link.startswith("/"):
            cur = []
        pending.extendleft(reversed(link.split("/")))
    return None


def find_link_into_verifier(
    roots: Iterable[tuple[str | os.PathLike, Sequence[str]]],
    host_of: HostOf,
    skip_top: frozenset[str] = frozenset(),
) -> str | None:
    """The first symlink under ``roots`` (host dir, the path it has in the sandbox's view) that leads
    into a verifier's place, as a reason; None if there is none. ``skip_top``: names not walked at the
    top of the view (dirs the agent cannot write, or walked through another root)."""
    seen = 0
    for root, view in roots:
        stack: list[tuple[str, list[str]]] = [(os.fspath(root), list(view))]
        while stack:
            d, parts = stack.pop()
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                seen += 1
                if seen > MAX_ENTRIES:
                    return f"more than {MAX_ENTRIES} files to check for links into the verifier's files"
                if not parts and e.name in skip_top:
                    continue
                try:
                    if e.is_symlink():
                        where = reaches_verifier(host_of, parts, os.readlink(e.path))
                        if where is not None:
                            path = "/" + "/".join([*parts, e.name])
                            return f"{path} is a link into the verifier's own files ({where})"
                    elif e.is_dir(follow_symlinks=False):
                        stack.append((e.path, [*parts, e.name]))
                except OSError:
                    continue  # gone while we looked: the agent is still running
    return None
