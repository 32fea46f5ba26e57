"""A persistent bash inside a sandbox: the agent's terminal.

Commands are sent to one long-lived ``bash`` over a pipe. Each command is passed through a quoted
here-doc and ``eval``-ed in the shell itself, so ``cd``/``export``/functions carry over, a syntax error
is just an error (it cannot swallow the protocol), and the command's stdin is /dev/null (it cannot
eat the next command). A marker line with a per-session nonce ends each command's output.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
import uuid
from collections.abc import Mapping

from tmax_jax.errors import SandboxError
from tmax_jax.sandbox.config import ExecResult
from tmax_jax.sandbox.procs import TRUNCATION_MARKER, kill_tree, parent_map

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _boot_ticks() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * CLK_TCK)


class ShellSession:
    """``run(cmd)`` returns an ExecResult whose ``stdout`` is the merged stdout+stderr of ``cmd``.

    On timeout or output flood only the processes started by that command are killed; the shell,
    its cwd, variables and earlier background jobs survive. If the shell itself dies (``exit``, a
    builtin busy loop) the next ``run`` starts a fresh one and says so in its output.
    """

    def __init__(self, sandbox, env: Mapping[str, str] | None = None, cwd: str | None = None):
        self.sandbox = sandbox
        self._env = dict(env or {})
        self._cwd = cwd
        self._nonce = uuid.uuid4().hex
        self.proc: subprocess.Popen | None = None
        self.shell_pid_inside: int | None = None
        self.restarts = 0
        self._start()

    # ---- process ---------------------------------------------------------------------------------
    def _start(self) -> None:
        sb = self.sandbox
        argv = ["/bin/bash", "--noprofile", "--norc"]
        host_argv = sb._exec_argv(argv, sb.environment(self._env), self._cwd or sb.workdir, interactive=True)
        self.proc = subprocess.Popen(
            host_argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=sb.host_env(),
        )
        os.set_blocking(self.proc.stdout.fileno(), False)
        self._buf = bytearray()
        self._host_shell_pid = None
        ready = f"__TMAX_READY_{self._nonce}"
        self._send(f"stty -echo 2>/dev/null; PS1=''; PS2=''; echo {ready} $$\n")
        line = self._read_until(ready.encode(), time.monotonic() + 30.0, want_line=True)
        if line is None:
            self.close()
            raise SandboxError(f"sandbox {sb.id}: shell did not start")
        try:
            self.shell_pid_inside = int(line.split()[-1])
        except (ValueError, IndexError) as e:
            raise SandboxError(f"sandbox {sb.id}: shell sent an unexpected greeting {line!r}") from e

    def _send(self, text: str) -> bool:
        try:
            self.proc.stdin.write(text.encode())
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def _read_until(self, token: bytes, deadline: float, want_line: bool = False) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while True:
            i = self._buf.find(token)
            if i >= 0:
                j = self._buf.find(b"\n", i)
                if j >= 0:
                    line = bytes(self._buf[i:j])
                    del self._buf[: j + 1]
                    return line
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], min(left, 0.5))
            if r:
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    return None
                self._buf += chunk

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ---- commands --------------------------------------------------------------------------------
    def run(self, cmd: str, timeout: float | None = None, max_output_bytes: int | None = None) -> ExecResult:
        sb = self.sandbox
        timeout = sb.clamp_timeout(timeout)
        cap = max_output_bytes or sb.cfg.max_output_bytes
        note = b""
        if not self.alive():
            self._kill_shell()
            self._start()
            self.restarts += 1
            note = b"[tmax-jax: the previous shell exited; this is a fresh shell]\n"
        t0 = time.monotonic()
        since = self.sandbox.shell_mark(self)
        tag = uuid.uuid4().hex[:8]
        done = f"__TMAX_DONE_{self._nonce}_{tag}_"
        eof = f"__TMAX_EOF_{self._nonce}"
        script = (
            f"IFS= read -r -d '' __tmax_cmd <<'{eof}'\n{cmd}\n{eof}\n"
            f'{{ eval "$__tmax_cmd"; }} </dev/null 2>&1; __tmax_rc=$?; '
            f"printf '\\n{done}%d\\n' \"$__tmax_rc\"\n"
        )
        if not self._send(script):
            return ExecResult(note.decode() + "[tmax-jax: shell is gone]\n", "", 127, False, False, 0.0)
        out, rc, timed_out, truncated = self._collect(done.encode(), t0 + timeout, cap, since)
        text = (note + out).decode("utf-8", "replace")
        if truncated:
            text += TRUNCATION_MARKER.format(cap=cap)
        dt = time.monotonic() - t0
        sb.exec_durations.append(dt)
        return ExecResult(text, "", rc, timed_out, truncated, dt)

    def _collect(self, done: bytes, deadline: float, cap: int, since: int):
        fd = self.proc.stdout.fileno()
        kept = bytearray()
        tail = bytearray()
        timed_out = truncated = False
        killed_at = None
        while True:
            data = bytes(self._buf)
            self._buf.clear()
            tail += data
            i = tail.find(done)
            if i >= 0:
                j = tail.find(b"\n", i)
                if j >= 0:
                    body = bytes(tail[:i])
                    rc = int(tail[i + len(done) : j] or b"1")
                    self._buf += tail[j + 1 :]
                    self._keep(kept, body, cap)
                    out = bytes(kept)
                    out = out[:-1] if out.endswith(b"\n") and not truncated else out
                    if len(kept) >= cap:
                        truncated = True
                    if timed_out:
                        rc = 124
                    elif truncated:
                        rc = 137
                    return out, rc, timed_out, truncated
            # Keep a tail long enough to see a marker split across reads.
            if len(tail) > len(done) + 32:
                cut = len(tail) - (len(done) + 32)
                self._keep(kept, bytes(tail[:cut]), cap)
                del tail[:cut]
                if len(kept) >= cap and not truncated:
                    truncated = True
            now = time.monotonic()
            if self.proc.poll() is not None and not self._drain(fd):
                # The shell exited (``exit``); a background job may still hold the pipe open.
                self._keep(kept, bytes(tail) + bytes(self._buf), cap)
                self._buf.clear()
                rc = self.proc.returncode
                self._kill_shell()
                return bytes(kept), 124 if timed_out else rc, timed_out, truncated
            if killed_at is None and (now >= deadline or truncated):
                timed_out = now >= deadline
                self._kill_command(since)
                killed_at = now
            elif killed_at is not None and now - killed_at > 3.0:
                # The shell itself is stuck (a builtin loop) or gone: start over next time.
                self._kill_shell()
                out = bytes(kept)
                return out, 124 if timed_out else 137, timed_out, truncated
            r, _, _ = select.select([fd], [], [], 0.2 if killed_at else max(0.0, min(deadline - now, 0.5)))
            if r:
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    self._kill_shell()
                    self._keep(kept, bytes(tail), cap)
                    rc = self.proc.returncode if self.proc.returncode is not None else 1
                    return bytes(kept), 124 if timed_out else rc, timed_out, truncated
                self._buf += chunk

    def _drain(self, fd: int) -> bool:
        """Read what is already in the pipe into the buffer; True if anything came."""
        got = False
        while select.select([fd], [], [], 0.05)[0]:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buf += chunk
            got = True
        return got

    @staticmethod
    def _keep(kept: bytearray, data: bytes, cap: int) -> None:
        room = cap - len(kept)
        if room > 0:
            kept += data[:room]

    def _kill_command(self, since) -> None:
        """Kill the processes this command started, keeping the shell and older background jobs."""
        self.sandbox.kill_command_processes(self, since)

    def _kill_shell(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
            try:
                self.sandbox._on_kill_shell(self)
            except Exception:  # noqa: BLE001
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._kill_shell()
        if self in self.sandbox._shells:
            self.sandbox._shells.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def descendants_started_after(stat_text: str, root_pid: int, since: int) -> list[int]:
    """From concatenated ``/proc/*/stat`` lines (as seen inside a sandbox), the descendants of
    ``root_pid`` whose start time (clock ticks since boot) is at or after ``since``."""
    pmap: dict[int, int] = {}
    start: dict[int, int] = {}
    for line in stat_text.splitlines():
        r = line.rfind(")")
        if r < 0:
            continue
        try:
            pid = int(line.split(" ", 1)[0])
            fields = line[r + 2 :].split()
            pmap[pid] = int(fields[1])
            start[pid] = int(fields[19])
        except (ValueError, IndexError):
            continue
    children: dict[int, list[int]] = {}
    for c, p in pmap.items():
        children.setdefault(p, []).append(c)
    out, todo = [], list(children.get(root_pid, []))
    while todo:
        p = todo.pop()
        if start.get(p, 0) >= since:
            out.append(p)
        todo.extend(children.get(p, []))
    return out


__all__ = ["ShellSession", "descendants_started_after", "parent_map"]
