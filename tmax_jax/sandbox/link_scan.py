"""Symlinks the agent made that lead a verifier into its own files.

A verifier sees the agent's files with its own ``/tests`` (the task's tests, expected outputs among
them) and ``/logs`` mounted beside them. A link the agent made, ``/app/answer.txt ->
/tests/expected.txt``, is dangling for the agent but is the answer for the tests: reading the agent's
output, they would read their own. ``/proc/self/root/tests/...``, ``/proc/self/cwd/...`` and
``/proc/PID/fd/N`` reach the verifier's files the same way, through its processes.

``find_link_into_verifier`` walks what the agent wrote and resolves each symlink there as the
verifier's kernel would (through other links, ``..`` included; a missing component is taken
lexically, since a process the agent left running could still create it). A link that reaches
``/tests``, ``/logs``, the verifier's scratch (``/tmp``, ``/var/tmp``, ``/dev/shm``), ``/dev/fd`` or a
``/proc`` path through a process's ``root``, ``cwd``, ``fd``,
``map_files`` or ``exe`` is reported; links to ``/proc/mounts``, ``/dev/null``, ``/dev/stdout`` and the
like are not. Both backends call it before and after a verification (``run_verifier``), and
``LinkWatch`` sees links made while the verifier runs.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from tmax_jax.sandbox import inotify

# Places only the verifier's own files are: a path reaching one of these prefixes is reported. Its
# scratch dirs are its own too (tmpfs of its mount namespace): the tests' temporary files, a copy of
# an expected output among them, are no more the agent's to link to than ``/tests``.
VERIFIER_DIRS = (("tests",), ("logs",), ("dev", "fd"), ("dev", "shm"), ("tmp",), ("var", "tmp"))
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


# ---- while the verifier runs ---------------------------------------------------------------------
_MASK = inotify.IN_CREATE | inotify.IN_MOVED_TO | inotify.IN_ONLYDIR | inotify.IN_DONT_FOLLOW
# Bulky trees the watch does not descend into (the scans before and after still walk them): package
# caches and installs that hold thousands of dirs each (inotify watches are a host-wide budget shared
# by every verification running), and where no test reads the agent's outputs.
_BULKY_NAMES = frozenset(
    {"node_modules", ".git", "__pycache__", "site-packages", "dist-packages", ".cache", ".npm", ".cargo"}
)
_BULKY_PATHS = frozenset(
    {
        ("usr", "share"),
        ("usr", "lib"),
        ("usr", "local", "lib"),
        ("usr", "include"),
        ("var", "lib"),
        ("var", "cache"),
    }
)


def _bulky(parts: tuple[str, ...]) -> bool:
    return bool(parts) and (parts[-1] in _BULKY_NAMES or parts in _BULKY_PATHS)


class LinkWatch(inotify.EventWatch):
    """Links made while a verifier runs, by a process the agent left: from ``start()`` to ``stop()``
    every dir under ``roots`` is watched (a dir that appears is watched from then on and its content
    checked), and each new entry is resolved as ``find_link_into_verifier`` does. ``stop()`` returns
    the first link into the verifier's files as a reason, or None.

    Start it before the scan that precedes the verifier: a link made before the watch is the scan's,
    one made after it the watch's. A link made and removed again before the watch's thread reads its
    event is missed; a process flipping one to win a race against the tests makes many, and the
    watch needs to see only one. Package trees (``_bulky``) are left to the scans.
    """

    what = "the agent's files for links"
    thread_name = "tmax-link-watch"
    overflow = "too many files made during verification to check them for links"

    def __init__(self, roots, host_of: HostOf, skip_top: frozenset[str] = frozenset()):
        super().__init__()
        self.roots = [(os.fspath(r), tuple(v)) for r, v in roots]
        self.host_of = host_of
        self.skip_top = skip_top

    def _check(self, path: str, parts: tuple[str, ...]) -> None:
        try:
            target = os.readlink(path)
        except OSError:
            return  # not a link, or gone
        where = reaches_verifier(self.host_of, parts[:-1], target)
        if where is not None:
            self._flag(
                f"/{'/'.join(parts)} is a link into the verifier's own files ({where}), made while it ran"
            )

    def _add(self, path: str, parts: tuple[str, ...], appeared: bool) -> None:
        todo = [(path, parts)]
        while todo:
            d, p = todo.pop()
            wd = self.add_watch(d, _MASK, f"/{'/'.join(p)} for links")
            if wd is None:
                continue
            self._wd[wd] = (d, p)
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                if not p and e.name in self.skip_top:
                    continue
                child = (*p, e.name)
                try:
                    if e.is_symlink():
                        if appeared:  # made between the dir's creation and its watch
                            self._check(e.path, child)
                    elif e.is_dir(follow_symlinks=False) and not _bulky(child):
                        todo.append((e.path, child))
                except OSError:
                    continue

    def _begin(self) -> None:
        for root, view in self.roots:
            self._add(root, view, appeared=False)

    def _event(self, watched: tuple[str, tuple[str, ...]], mask: int, name: str) -> None:
        if not name:
            return
        d, parts = watched
        if not parts and name in self.skip_top:
            return
        path, child = os.path.join(d, name), (*parts, name)
        if mask & inotify.IN_ISDIR:
            if not _bulky(child):
                self._add(path, child, appeared=True)
        else:
            self._check(path, child)
