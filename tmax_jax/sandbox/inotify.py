"""A background inotify reader for the watches that run beside a verifier (``podman_toolchain.Watch``,
``link_scan.LinkWatch``): one inotify instance, a thread handing each event to ``_event``, and the
first reason recorded with ``_flag``, which ``stop()`` returns."""

from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
import threading

from tmax_jax.errors import SandboxError

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED, IN_ISDIR = 0x400, 0x800, 0x4000, 0x8000, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000
_EVENT = struct.Struct("iIII")
_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


class EventWatch:
    """Subclasses add their watches in ``_begin`` (``add_watch``, keeping what each watch descriptor
    stands for in ``_wd``) and handle events in ``_event``; a lost event (queue overflow) is flagged
    with ``overflow``."""

    what = "the agent's files"  # what is watched, for errors
    thread_name = "tmax-watch"
    overflow = "too many filesystem changes during verification to check them"

    def __init__(self) -> None:
        self._wd: dict = {}  # watch descriptor -> what the subclass watches there
        self._reason: str | None = None
        self._fd = -1
        self._stop = threading.Event()
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None

    def _flag(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason

    def add_watch(self, path: str, mask: int, shown: str) -> int | None:
        """The watch descriptor; None when ``path`` is gone or not a dir (the agent is still
        running), or cannot be watched, which is flagged ("cannot watch ``shown`` ...")."""
        wd = libc().inotify_add_watch(self._fd, os.fsencode(path), mask)
        if wd >= 0:
            return wd
        err = ctypes.get_errno()
        if err not in (errno.ENOENT, errno.ENOTDIR):
            self._flag(f"cannot watch {shown} during verification: {os.strerror(err)}")
        return None

    def _begin(self) -> None:
        raise NotImplementedError

    def _event(self, watched, mask: int, name: str) -> None:
        """One event in the dir ``self._wd`` keeps as ``watched`` (``name``: the entry, '' for the dir)."""
        raise NotImplementedError

    def _dispatch(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self._flag(self.overflow)
        elif mask & IN_IGNORED:
            self._wd.pop(wd, None)
        elif wd in self._wd:
            self._event(self._wd[wd], mask, name)

    def start(self):
        self._fd = libc().inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            # A host limit (inotify instances), not the agent's doing.
            raise SandboxError(f"cannot watch {self.what}: inotify: {os.strerror(ctypes.get_errno())}")
        self._begin()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> bool:
        try:
            buf = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return False
        i = 0
        while i + _EVENT.size <= len(buf):
            wd, mask, _cookie, n = _EVENT.unpack_from(buf, i)
            name = os.fsdecode(buf[i + _EVENT.size : i + _EVENT.size + n].rstrip(b"\0"))
            i += _EVENT.size + n
            self._dispatch(wd, mask, name)
        return True

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                r, _, _ = select.select([self._fd, self._wake_r], [], [], 1.0)
                if self._fd in r:
                    self._read()
        except Exception as e:  # noqa: BLE001 - a watch that stopped watching must not pass silently
            self._flag(f"watching {self.what} during verification failed: {type(e).__name__}: {e}")

    def stop(self) -> str | None:
        if self._thread is not None:
            self._stop.set()
            os.write(self._wake_w, b"x")
            self._thread.join()
            while self._read():
                pass
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._thread = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        return self._reason
