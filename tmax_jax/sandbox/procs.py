"""Host-side process helpers: process trees from /proc, killing them, capped and timed capture."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# What a container tool (podman, apptainer) started on the host may see of the trainer's environment:
# where to find itself and its storage, nothing else. podman copies the proxy variables it inherits
# (with any ``user:password@``) into containers, apptainer turns ``APPTAINERENV_*`` into container
# variables, and both would pass on API keys an image's build or a verifier might print.
_TOOL_VARS = (
    "PATH", "HOME", "USER", "LOGNAME", "TMPDIR", "LANG",
    "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME",
)  # fmt: skip
# Host-side configuration of the tools themselves (storage, registries, cache dirs).
_TOOL_PREFIXES = ("CONTAINERS_", "BUILDAH_", "APPTAINER_", "SINGULARITY_")
_TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def tool_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every podman and apptainer command runs with: the variables those tools need
    from ``environ`` (default ``os.environ``) and nothing of the trainer's (proxies, API keys)."""
    src = os.environ if environ is None else environ
    out = {k: src[k] for k in _TOOL_VARS if k in src}
    out.update({k: v for k, v in src.items() if k.startswith(_TOOL_PREFIXES)})
    out.setdefault("PATH", _TOOL_PATH)
    return out


TRUNCATION_MARKER = "\n[... output truncated by tmax-jax sandbox: more than {cap} bytes ...]\n"


def parent_map(proc_root: str = "/proc") -> dict[int, int]:
    """pid -> ppid for every process visible under ``proc_root``."""
    out: dict[int, int] = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc_root}/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces and parentheses: the fields after the last ')' are fixed.
        rest = stat[stat.rfind(b")") + 2 :].split()
        out[int(name)] = int(rest[1])
    return out


def descendants(pid: int, pmap: dict[int, int] | None = None) -> list[int]:
    """All descendants of ``pid`` (not ``pid`` itself), parents before children."""
    pmap = parent_map() if pmap is None else pmap
    children: dict[int, list[int]] = {}
    for child, parent in pmap.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (one read of its ``children`` file; a walk of /proc without)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        pmap = parent_map()
        return [c for c, p in pmap.items() if p == pid]


def kill_tree(pid: int, include_self: bool = True, sig: int = signal.SIGKILL) -> None:
    """SIGKILL a process, its process group and every descendant (two passes to catch late forks)."""
    for _ in range(2):
        victims = descendants(pid)
        if include_self:
            victims.append(pid)
        try:
            os.killpg(pid, sig)
        except OSError:
            pass
        for v in victims:
            try:
                os.kill(v, sig)
            except OSError:
                pass


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"


def stop_pid_namespace(member: int, keep: frozenset[int], timeout: float = 5.0) -> bool:
    """SIGKILL every process in ``member``'s pid namespace but those in ``keep`` (host pids: the
    namespace's init and what holds it open), pass after pass until none is left (a process may fork
    while we kill). Returns whether none is left; False also when the namespace cannot be read."""
    try:
        ns = os.readlink(f"/proc/{member}/ns/pid")
    except OSError:
        return False
    deadline = time.monotonic() + timeout
    while True:
        victims = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == ns and pid_alive(int(name)):
                    victims.append(int(name))
            except OSError:
                continue  # gone, or a zombie: it holds nothing
        if not victims:
            return True
        if time.monotonic() > deadline:
            return False
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)


@dataclass
class Captured:
    stdout: bytes
    stderr: bytes
    exit_code: int
    timed_out: bool
    truncated: bool
    duration_s: float


def run_capped(
    argv: Sequence[str],
    *,
    timeout: float,
    cap: int,
    stdin: bytes | None = None,
    env: dict[str, str] | None = None,
    on_kill: Callable[[subprocess.Popen], None] | None = None,
    cap_stdout: bool = True,
    pass_fds: Sequence[int] = (),
) -> Captured:
    """Run ``argv`` on the host, reading stdout/stderr with a combined cap and a wall-time limit.

    On timeout (exit 124) or when the output passes ``cap`` bytes (exit 137, truncated), the whole
    process tree is killed (and ``on_kill`` runs, for backends whose processes are not our children).
    ``cap_stdout=False`` keeps all of stdout (for file downloads) but still caps stderr. ``pass_fds``:
    open fds the command inherits (bwrap binds directories from them).
    """
    t0 = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        close_fds=True,
        pass_fds=tuple(pass_fds),
    )
    if stdin is not None:

        def feed():
            try:
                proc.stdin.write(stdin)
            except OSError:
                pass
            finally:
                try:
                    proc.stdin.close()
                except OSError:
                    pass

        threading.Thread(target=feed, daemon=True).start()
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    counted = {out_fd: cap_stdout, err_fd: True}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    timed_out = truncated = False
    total = 0
    deadline = t0 + timeout
    killed_at = None
    exited_at = None
    while sel.get_map():
        now = time.monotonic()
        if killed_at is None and now >= deadline:
            timed_out = True
        if killed_at is None and (timed_out or truncated):
            _kill(proc, on_kill)
            killed_at = now
        if killed_at is not None and now - killed_at > 2.0:
            break  # a process that escaped the tree still holds the pipe; stop waiting for it
        if killed_at is None and exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.25:
            # The command is done; a background child still holds the pipe: stop reading.
            break
        wait = 0.5 if killed_at is not None else max(0.0, min(deadline - now, 0.05))
        if exited_at is not None:
            wait = 0.05
        for key, _ in sel.select(timeout=wait):
            fd = key.fd
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                sel.unregister(fd)
                continue
            if killed_at is not None:
                continue
            buf = bufs[fd]
            if counted[fd]:
                room = cap - total
                if len(chunk) > room:
                    buf += chunk[: max(room, 0)]
                    total = cap
                    truncated = True
                    continue
                total += len(chunk)
            buf += chunk
    sel.close()
    try:
        rc = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill(proc, on_kill)
        rc = proc.wait()
    for f in (proc.stdout, proc.stderr):
        f.close()
    if timed_out:
        rc = 124
    elif truncated:
        rc = 137
    out, err = bytes(bufs[out_fd]), bytes(bufs[err_fd])
    return Captured(out, err, rc, timed_out, truncated, time.monotonic() - t0)


def _kill(proc: subprocess.Popen, on_kill) -> None:
    if on_kill is not None:
        try:
            on_kill(proc)
        except Exception:  # noqa: BLE001 - killing is best effort, the tree kill below still runs
            pass
    kill_tree(proc.pid)
