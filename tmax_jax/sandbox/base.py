"""The sandbox interface every backend implements, and the parts they share."""

from __future__ import annotations

import abc
import io
import json
import os
import shlex
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tmax_jax.errors import SandboxError
from tmax_jax.sandbox import registry, verifier_guard
from tmax_jax.sandbox.config import ExecResult, SandboxConfig
from tmax_jax.sandbox.procs import TRUNCATION_MARKER, run_capped

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class EpisodeTimeout(SandboxError):
    """The sandbox's episode wall time is spent; nothing more may run in it."""


# What a verifier sees of itself: a fixed PATH, a HOME and working directory the agent never wrote.
VERIFIER_PATH = BASE_PATH
# The verifier's Python puts no agent-writable directory before the standard library and
# site-packages: PYTHONSAFEPATH keeps the working / script directory off sys.path, and a
# ``usercustomize`` under /tests (the verifier's own mount; see ``write_verifier_python``) adds a
# finder that searches it after every other place instead, for the tests' and the agent's own
# imports only (never one the standard library or site-packages makes, as ``copy`` probing ``org``).
# ``python3 -m pkg`` from /app and a script's sibling modules still import, as under Docker, but a
# ``pytest.py`` or ``json.py`` that a process the agent left plants in /app while the tests run, or
# an ``org/`` there, cannot stand in for the real one or run as the verifier's tools load, and a
# ``*.dist-info`` there registers no pytest plugin (metadata is listed from sys.path only). The user
# base is that dir, so no user site of the agent's (``~/.local``) is read.
VERIFIER_PYTHON_DIR = "/tests/.tmax-verifier-python"
VERIFIER_ENV = {
    "PATH": VERIFIER_PATH,
    "HOME": "/tests",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "USER": "root",
    "PYTHONSAFEPATH": "1",
    "PYTHONUSERBASE": VERIFIER_PYTHON_DIR,
    "PYTHONDONTWRITEBYTECODE": "1",
    # Its scratch space is its own tmpfs (the backends mount /tmp, /var/tmp and /dev/shm afresh), and
    # the shell its tools start is the image's, whatever the image's variables say.
    "TMPDIR": "/tmp",
    "SHELL": "/bin/bash",
}
# The verifier's own pytest plugin (``_CTRF_PLUGIN``), for tests that ask for ``--ctrf``: most
# Terminal-Bench 2 verifiers run `pytest --ctrf /logs/verifier/ctrf.json`, whose plugin their
# Dockerfile pip-installs; offline, or on bwrap's read-only host Python, it is missing and pytest
# would refuse the option. On PYTHONPATH rather than the user site, which virtualenvs skip.
VERIFIER_PLUGIN_DIR = f"{VERIFIER_PYTHON_DIR}/plugins"
# The same dir relative to /tests (the copy of the tests the sandbox mounts there).
VERIFIER_PYTHON_REL = VERIFIER_PYTHON_DIR.removeprefix("/tests/")
# Every pytest the verifier runs loads ``tmax_guard`` (``verifier_guard.py``: what the code under test
# may not do to the session), writing its records to GUARD_DIR, beside /logs/verifier.
VERIFIER_PLUGIN_ENV = {
    "PYTHONPATH": VERIFIER_PLUGIN_DIR,
    "PYTEST_PLUGINS": verifier_guard.PLUGIN_NAME,
    "TMAX_GUARD_DIR": verifier_guard.GUARD_DIR,
    "TMAX_GUARD_TESTS": "/tests",
    "TMAX_GUARD_OWN_PIDNS": "1",  # every backend's verifier has a pid namespace of its own
}

_USERCUSTOMIZE = """\
# Written by tmax-jax for the verifier. The directory Python would have put first on sys.path (the
# working directory for -m / -c, else the script's) is searched last, after the standard library
# and site-packages, and for modules only: it is not on sys.path, so package metadata there (a
# *.dist-info whose entry points name a pytest plugin) is never listed.
#
# It serves only what the tests' own code asks for by name: the module ``python3 -m`` runs, a test's
# ``import solution``, what those modules import in turn, a name that ``unittest`` was given. Never
# a name of the standard library, nor an import the standard library or site-packages makes of its
# own accord: those are optional dependencies probed in a try block (``copy`` asks for
# ``org.python.core``, urllib3 for ``brotli``), and a module of the agent's by such a name would run
# as the verifier before any test.
import importlib.machinery as _machinery
import os as _os
import sys as _sys


class _TmaxLastDir:
    path = ""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is not None:  # a submodule: its package's __path__ is searched by the usual finder
            return None
        if name in getattr(_sys, "stdlib_module_names", ()) or not cls.asked_by_tests(name):
            return None
        return _machinery.PathFinder.find_spec(name, [cls.path])

    @staticmethod
    def module(frame):
        return frame.f_globals.get("__name__") or ""

    @classmethod
    def asked_by_tests(cls, name):
        \"\"\"Whether the code importing ``name`` is the tests' or the agent's, not a library's.\"\"\"
        frame = _sys._getframe(2)
        # importlib's frames, and pytest.importorskip's, import on behalf of their caller.
        while frame is not None and (
            frame.f_code.co_filename.startswith("<frozen importlib")
            or cls.module(frame).partition(".")[0] == "importlib"
            or cls.module(frame) == "_pytest.outcomes"
        ):
            frame = frame.f_back
        if frame is None:
            return False
        mod = cls.module(frame)
        if mod == "runpy":  # ``python3 -m NAME``: the module it names, nothing else
            f = frame
            while f is not None:
                if f.f_code.co_name == "_run_module_as_main" and cls.module(f) == "runpy":
                    return str(f.f_locals.get("mod_name", "")).partition(".")[0] == name
                f = f.f_back
            return False
        if mod.startswith("unittest."):  # the names ``python3 -m unittest`` was given
            return True
        file = frame.f_code.co_filename
        return not (file.startswith("<frozen ") or cls.library(file))

    @staticmethod
    def library(file):
        roots = [_os.path.dirname(_os.__file__), __TMAX_PYTHON_DIR__]
        roots += [p for p in _sys.path if _os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")]
        return any(file.startswith(r.rstrip("/") + "/") for r in roots if r)


# The guard plugin (``verifier_guard``) stays importable when a test script sets its own PYTHONPATH.
if _os.path.isdir(__TMAX_PLUGINS__) and __TMAX_PLUGINS__ not in _sys.path:
    _sys.path.append(__TMAX_PLUGINS__)
_a = _sys.argv[0] if _sys.argv else ""
_TmaxLastDir.path = _os.getcwd() if _a in ("", "-m", "-c") else _os.path.dirname(_os.path.abspath(_a))
if _TmaxLastDir.path not in _sys.path:
    _sys.meta_path.append(_TmaxLastDir)
del _a
"""


# ``--ctrf PATH``: a Common Test Report Format JSON of the session (the summary and each test's
# status and duration), as the pytest-json-ctrf plugin writes it. When that plugin is installed
# and loaded first (an image built with it, autoload on), it owns the option and this one stands down.
_CTRF_PLUGIN = """\
# Written by tmax-jax for the verifier: pytest's --ctrf report (see tmax_jax/sandbox/base.py).
import json
import os
import time

_state = {"on": False, "start": None, "tests": {}}


def pytest_addoption(parser):
    try:
        parser.getgroup("ctrf").addoption(
            "--ctrf", action="store", dest="tmax_ctrf_path", default=None,
            help="write a CTRF JSON report of the session to this path",
        )
        _state["on"] = True
    except ValueError:  # the real pytest-json-ctrf registered --ctrf first
        pass


def pytest_sessionstart(session):
    _state["start"] = int(time.time() * 1000)


def pytest_runtest_logreport(report):
    if not _state["on"]:
        return
    t = _state["tests"].setdefault(report.nodeid, {"name": report.nodeid, "status": "passed", "duration": 0})
    t["duration"] += int(round(report.duration * 1000))
    if report.failed:
        t["status"] = "failed"
    elif report.skipped and t["status"] == "passed":
        t["status"] = "skipped"


def pytest_sessionfinish(session, exitstatus):
    path = _state["on"] and session.config.getoption("tmax_ctrf_path", None)
    if not path:
        return
    tests = list(_state["tests"].values())
    count = lambda s: sum(t["status"] == s for t in tests)
    summary = {
        "tests": len(tests), "passed": count("passed"), "failed": count("failed"),
        "skipped": count("skipped"), "pending": 0, "other": 0,
        "start": _state["start"] or int(time.time() * 1000), "stop": int(time.time() * 1000),
    }
    doc = {"results": {"tool": {"name": "pytest"}, "summary": summary, "tests": tests}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
"""


def _asks_for_ctrf(tests_copy: Path) -> bool:
    """Whether a shell script of the tests passes ``--ctrf`` (to pytest)."""
    for p in Path(tests_copy).rglob("*.sh"):
        try:
            if (
                p.is_file()
                and not p.is_symlink()
                and p.stat().st_size < (1 << 20)
                and b"--ctrf" in p.read_bytes()
            ):
                return True
        except OSError:
            continue
    return False


def write_verifier_python(tests_copy: Path) -> dict[str, str]:
    """Put the verifier's ``usercustomize`` into the copy of the tests that becomes /tests (one per
    Python minor version the base may run, since the user site's path names it), its guard plugin
    (``verifier_guard``), and its ``--ctrf`` pytest plugin when the tests use that option. Returns
    what the verifier's environment adds for them (``VERIFIER_PLUGIN_ENV``, with ``tmax_ctrf`` when
    asked for); merge a task's own with ``verifier_guard.merge_env``."""
    base = Path(tests_copy) / VERIFIER_PYTHON_REL
    for minor in range(6, 20):
        site = base / "lib" / f"python3.{minor}" / "site-packages"
        site.mkdir(parents=True, exist_ok=True)
        (site / "usercustomize.py").write_text(
            _USERCUSTOMIZE.replace("__TMAX_PLUGINS__", repr(VERIFIER_PLUGIN_DIR)).replace(
                "__TMAX_PYTHON_DIR__", repr(VERIFIER_PYTHON_DIR)
            )
        )
    plugins = Path(tests_copy) / Path(VERIFIER_PLUGIN_DIR).relative_to("/tests")
    plugins.mkdir(parents=True, exist_ok=True)
    (plugins / f"{verifier_guard.PLUGIN_NAME}.py").write_text(verifier_guard.plugin_text())
    env = dict(VERIFIER_PLUGIN_ENV)
    fits = verifier_guard.tests_fit_readonly(tests_copy, VERIFIER_PYTHON_REL)
    env["TMAX_GUARD_ALL_RO"] = "1" if fits else "0"
    if _asks_for_ctrf(tests_copy):
        (plugins / "tmax_ctrf.py").write_text(_CTRF_PLUGIN)
        env["PYTEST_PLUGINS"] += ",tmax_ctrf"
    return env


# Variables that change how a shell or Python starts, or what it loads: never taken from the image
# (which the agent may have shaped) into a verifier.
_STARTUP_VARS = frozenset(
    {
        "PATH", "HOME", "ENV", "BASH_ENV", "PROMPT_COMMAND", "PYTHONPATH", "PYTHONHOME",
        "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONINSPECT", "PYTHONWARNINGS", "PYTEST_ADDOPTS",
        "PYTEST_PLUGINS", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PERL5OPT", "NODE_OPTIONS",
    }
)  # fmt: skip


def stage_tests(vdir: Path, tests_dir: str | os.PathLike, size_mb: int, owner: int | None) -> Path:
    """Make a verification's host dir ``vdir`` (a tmpfs of ``size_mb`` owned by host uid ``owner``,
    when given: what the tests leave there neither fills the host's disk nor outlives the
    verification, whose unmount removes it at once) and copy the tests to its ``tests``."""
    vdir.mkdir(mode=0o700)
    if owner is not None:
        opts = f"size={size_mb}m,mode=0700,uid={owner},gid={owner}"
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(vdir)], capture_output=True, text=True
        )
        if r.returncode != 0:
            raise SandboxError(f"could not mount the verifier's tmpfs: {r.stderr.strip()}")
    try:
        shutil.copytree(tests_dir, vdir / "tests", symlinks=True)
    except OSError as e:  # shutil.Error is one
        raise SandboxError(f"the tests do not fit the task's storage ({size_mb} MB): {e}") from e
    return vdir / "tests"


def safe_extract(tar: tarfile.TarFile, dest: str) -> None:
    """Extract an archive a hostile sandbox may have made: tarfile's "data" filter (absolute paths,
    paths or links out of the tree, device files and fifos refused; no setuid bits, no group/other
    write, no archive ownership). Python before 3.11.4 (Debian 12's 3.11.2) has no filters: the
    same refusals are made here, member by member, before anything is written."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    root = os.path.realpath(dest)

    def inside(path: str) -> bool:
        return path == root or path.startswith(root + os.sep)

    members = tar.getmembers()
    for m in members:
        if os.path.isabs(m.name) or ".." in PurePosixPath(m.name).parts:
            raise tarfile.TarError(f"{m.name!r} points outside the archive")
        if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
            raise tarfile.TarError(f"{m.name!r} is a device, fifo or other special file")
        path = os.path.join(root, m.name)
        if not inside(os.path.realpath(path)):
            raise tarfile.TarError(f"{m.name!r} would be written outside the destination")
        if m.issym() or m.islnk():
            if os.path.isabs(m.linkname):
                raise tarfile.TarError(f"{m.name!r} links to an absolute path")
            base = os.path.dirname(path) if m.issym() else root
            if not inside(os.path.realpath(os.path.join(base, m.linkname))):
                raise tarfile.TarError(f"{m.name!r} links outside the archive")
        m.mode &= 0o755 if m.isdir() or m.mode & 0o100 else 0o644
        m.uid, m.gid, m.uname, m.gname = os.getuid(), os.getgid(), "", ""
    tar.extractall(dest, members=members)


def exec_result(got, cap: int) -> ExecResult:
    """An ``ExecResult`` from a ``procs.Captured`` (decoded, truncation marked)."""
    out = got.stdout.decode("utf-8", "replace")
    err = got.stderr.decode("utf-8", "replace")
    if got.truncated:
        err += TRUNCATION_MARKER.format(cap=cap)
    return ExecResult(out, err, got.exit_code, got.timed_out, got.truncated, got.duration_s)


def read_verifier_logs(
    d: Path, max_bytes: int = 4 << 20, max_files: int = 256, max_depth: int = 8
) -> dict[str, bytes]:
    """The regular files in a verifier's logs dir ``d`` and its subdirectories, relative path ->
    bytes (each cut at ``max_bytes``; at most ``max_files``, in path order). Every component is
    opened relative to its parent without following links, so links, fifos and devices a verifier
    may have made there are skipped, never followed."""
    out: dict[str, bytes] = {}
    try:
        top = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return out

    def walk(dir_fd: int, prefix: str, depth: int) -> None:
        try:
            names = sorted(os.listdir(dir_fd))
        except OSError:
            return
        for name in names:
            if len(out) >= max_files:
                return
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                mode = os.fstat(fd).st_mode
                if stat.S_ISREG(mode):
                    with os.fdopen(os.dup(fd), "rb") as f:
                        out[prefix + name] = f.read(max_bytes)
                elif stat.S_ISDIR(mode) and depth < max_depth:
                    walk(fd, f"{prefix}{name}/", depth + 1)
            finally:
                os.close(fd)

    try:
        walk(top, "", 0)
    finally:
        os.close(top)
    return out


@dataclass
class VerifierRun:
    """What ``Sandbox.run_verifier`` returns.

    result: the verifier command's outcome. logs: the regular files the verifier left in its own
    ``/logs/verifier`` (name -> bytes, read from where no agent process can reach). tampered: a reason
    when the backend found the verifier's toolchain changed by the agent, or its guard found the code
    under test changing the session (then the reward is 0). suspect: a reason no positive reward of
    this verification is trusted (a pytest session that never finished; ``verifier_guard``).
    """

    result: ExecResult
    logs: dict[str, bytes]
    tampered: str | None = None
    suspect: str | None = None


class Sandbox(abc.ABC):
    """One isolated machine for one episode. Use as a context manager; ``close`` always cleans up.

    ``exec`` runs one command in a fresh ``bash -c`` (cwd and env do not carry over); ``shell()``
    gives a persistent bash whose cwd, variables and background jobs carry across ``run`` calls.
    """

    backend = "base"

    def __init__(self, cfg: SandboxConfig, env: Mapping[str, str] | None = None, workdir: str | None = None):
        self.cfg = cfg
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.image_env = dict(env or {})
        self.workdir = workdir or cfg.workdir
        self.started_at = time.monotonic()
        self.deadline = self.started_at + cfg.episode_timeout_s
        self.start_latency_s = 0.0
        self._closed = False
        self._close_lock = threading.Lock()
        self._shells: list = []
        self._left_behind = False  # a dir of the sandbox's that ``_close`` could not remove
        self.run_dir = cfg.resolved_run_dir / self.id
        self.exec_count = 0
        self.exec_durations: list[float] = []
        # The image's final ``USER`` (Docker's ``user[:group]``), for the agent's commands; None: root.
        self.user: str | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Sandbox:
        t0 = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=False)
        registry.register(self)
        try:
            self._write_owner()
            self._start()
        except BaseException:
            self.close()
            raise
        self.start_latency_s = time.monotonic() - t0
        self.started_at = time.monotonic()
        self.deadline = self.started_at + self.cfg.episode_timeout_s
        return self

    def _write_owner(self, **extra) -> None:
        rec = registry.owner_record({"backend": self.backend, **self._owner_extra(), **extra})
        (self.run_dir / "owner.json").write_text(json.dumps(rec))

    def _owner_extra(self) -> dict:
        return {}

    def close(self) -> None:
        """Kill every process of the sandbox and remove its dirs/containers. Safe to call twice."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for sh in list(self._shells):
            sh.close()
        try:
            self._close()
        finally:
            # A dir that could not be removed (said on stderr) is recorded for the stale sweep; the
            # episode goes on either way.
            if not registry.cleanup_record(self.run_dir, {}) or self._left_behind:
                rec = {"backend": self.backend, **self._owner_extra()}
                registry.keep_for_sweep(self.run_dir, registry.owner_record(rec))
            registry.unregister(self)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def alive(self) -> bool:
        return not self._closed and self._alive()

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    # ---- commands --------------------------------------------------------------------------------
    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        out = {"PATH": BASE_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb", "USER": "root"}
        if self.user is not None:
            name = self.user.partition(":")[0]
            out["USER"] = name if not name.isdigit() else out["USER"]
        out.update(self._backend_env())
        out.update(self.image_env)
        out.update(dict(self.cfg.env))
        out.update(env or {})
        return out

    def host_env(self) -> dict[str, str] | None:
        """The environment of the host-side process that runs a command in the sandbox (None: this
        process's own; backends whose tool passes its environment on give an explicit one)."""
        return None

    def _backend_env(self) -> dict[str, str]:
        return {}

    def internal_environment(self) -> dict[str, str]:
        """For the runner's own commands (file transfer, process listing): nothing the agent set."""
        return {"PATH": BASE_PATH, "HOME": "/", "LANG": "C.UTF-8", "TERM": "dumb"}

    def verifier_environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The verifier's environment: the image's variables without the ones that steer start-up,
        the backend's, then ``VERIFIER_ENV``; the image's PATH entries come after the base's."""
        out = {k: v for k, v in self.image_env.items() if k not in _STARTUP_VARS}
        out.update(self._backend_env())
        base_path = out.get("PATH", VERIFIER_PATH)
        out.update(VERIFIER_ENV)
        extra = [p for p in self.image_env.get("PATH", "").split(":") if p and p not in base_path.split(":")]
        out["PATH"] = ":".join([base_path, *extra])
        out.update(env or {})
        return out

    def clamp_timeout(self, timeout: float | None) -> float:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        remaining = self.remaining_s()
        if remaining <= 0:
            raise EpisodeTimeout(
                f"sandbox {self.id}: episode time limit ({self.cfg.episode_timeout_s}s) spent"
            )
        return min(timeout if timeout is not None else self.cfg.exec_timeout_s, remaining)

    def exec(
        self,
        cmd: str | Sequence[str],
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a shell string for bash, or an argv list) and wait for it.

        The command is killed at ``timeout`` (exit 124, ``timed_out``) or when stdout+stderr pass
        ``max_output_bytes`` (exit 137, ``truncated``, marker appended).
        """
        argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise SandboxError("exec: empty command")
        cap = max_output_bytes or self.cfg.max_output_bytes
        data = stdin.encode() if isinstance(stdin, str) else stdin
        got = self._run(argv, timeout=self.clamp_timeout(timeout), stdin=data, env=env, cwd=cwd, cap=cap)
        return exec_result(got, cap)

    def _run(self, argv, *, timeout, stdin, env, cwd, cap, cap_stdout=True, internal=False):
        """``internal``: one of the runner's own commands, run with ``internal_environment()``."""
        self.exec_count += 1
        host_argv = self._exec_argv(
            argv,
            self.internal_environment() if internal else self.environment(env),
            cwd or self.workdir,
            interactive=stdin is not None,
            internal=internal,
        )
        got = run_capped(
            host_argv,
            timeout=timeout,
            cap=cap,
            stdin=stdin,
            env=self.host_env(),
            on_kill=self._on_kill,
            cap_stdout=cap_stdout,
        )
        self.exec_durations.append(got.duration_s)
        if self._closed:
            raise SandboxError(f"sandbox {self.id} was closed while the command ran")
        return got

    def shell(self, env: Mapping[str, str] | None = None, cwd: str | None = None):
        """A persistent bash session (see ``ShellSession``)."""
        from tmax_jax.sandbox.shell import ShellSession

        sh = ShellSession(self, env=env, cwd=cwd)
        self._shells.append(sh)
        return sh

    # ---- files -----------------------------------------------------------------------------------
    def upload(
        self, local_path: str | os.PathLike, remote_path: str, timeout: float = 120.0, replace: bool = True
    ) -> None:
        """Copy a host file or directory to ``remote_path`` inside (parents created).

        ``replace``: remove what is at ``remote_path`` first (else a directory is merged into it).
        """
        local = Path(local_path)
        if not local.exists():
            raise SandboxError(f"upload: local path does not exist: {local}")
        remote = PurePosixPath(_absolute(remote_path))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(str(local), arcname=remote.name)
        self._untar(buf.getvalue(), str(remote.parent), remote.name, timeout, replace)

    def write_file(
        self, remote_path: str, data: str | bytes, mode: int = 0o644, timeout: float = 60.0
    ) -> None:
        remote = PurePosixPath(_absolute(remote_path))
        raw = data.encode() if isinstance(data, str) else data
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(remote.name)
            info.size, info.mode, info.mtime = len(raw), mode, int(time.time())
            tar.addfile(info, io.BytesIO(raw))
        self._untar(buf.getvalue(), str(remote.parent), remote.name, timeout)

    def _untar(self, blob: bytes, parent: str, name: str, timeout: float, replace: bool = True) -> None:
        q = shlex.quote
        target = q(parent.rstrip("/") + "/" + name)
        # A writable path is a mount point: empty it rather than removing it.
        rm = (
            f"{{ if [ -d {target} ] && [ ! -L {target} ]; then /usr/bin/find {target} -mindepth 1 -delete; else /bin/rm -rf {target}; fi; }} && "
            if replace
            else ""
        )
        script = f"/bin/mkdir -p {q(parent)} && {rm}/bin/tar -x -o -C {q(parent)}"
        got = self._run(
            ["/bin/bash", "-c", script],
            timeout=self.clamp_timeout(timeout),
            stdin=blob,
            env=None,
            cwd="/",
            cap=1 << 16,
            internal=True,
        )
        if got.exit_code != 0:
            raise SandboxError(
                f"upload to {parent}/{name} failed (exit {got.exit_code}): {got.stderr.decode(errors='replace')[-500:]}"
            )

    def download(self, remote_path: str, local_path: str | os.PathLike, timeout: float = 120.0) -> None:
        """Copy a file or directory from inside the sandbox to ``local_path`` on the host."""
        blob = self._tar_out(remote_path, timeout)
        local = Path(local_path)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
                    safe_extract(tar, tmp)
            except (tarfile.TarError, OSError) as e:
                raise SandboxError(f"download of {remote_path}: the sandbox sent a bad archive: {e}") from e
            got = Path(tmp) / PurePosixPath(remote_path).name
            if local.is_dir() and not got.is_dir():
                local = local / got.name
            elif local.exists():
                shutil.rmtree(local) if local.is_dir() else local.unlink()
            local.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(got), str(local))

    def read_file(self, remote_path: str, timeout: float = 60.0, max_bytes: int = 64 << 20) -> bytes:
        blob = self._tar_out(remote_path, timeout, max_bytes)
        try:
            with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
                member = tar.next()
                if member is None or not member.isfile():
                    raise SandboxError(f"read_file: {remote_path} is not a regular file")
                return tar.extractfile(member).read()
        except (tarfile.TarError, OSError) as e:
            raise SandboxError(f"read_file {remote_path}: the sandbox sent a bad archive: {e}") from e

    def _tar_out(self, remote_path: str, timeout: float, max_bytes: int = 4 << 30) -> bytes:
        remote = PurePosixPath(_absolute(remote_path))
        q = shlex.quote
        script = f"test -e {q(str(remote))} || {{ echo 'no such path' >&2; exit 3; }}; /bin/tar -c -C {q(str(remote.parent))} {q(remote.name)}"
        got = self._run(
            ["/bin/bash", "-c", script],
            timeout=self.clamp_timeout(timeout),
            stdin=None,
            env=None,
            cwd="/",
            cap=max_bytes,
            cap_stdout=max_bytes < (4 << 30),
            internal=True,
        )
        if got.exit_code == 3:
            raise SandboxError(f"download: {remote_path} does not exist in the sandbox")
        if got.exit_code != 0:
            raise SandboxError(
                f"download of {remote_path} failed (exit {got.exit_code}): {got.stderr.decode(errors='replace')[-500:]}"
            )
        return got.stdout

    def shell_mark(self, session):
        """Taken before each shell command; ``kill_command_processes`` kills what came after it."""
        from tmax_jax.sandbox.shell import _boot_ticks

        return _boot_ticks()

    def kill_command_processes(self, session, since) -> None:
        """Kill the descendants of ``session``'s shell started at/after ``since`` (boot clock ticks).

        Generic version: read /proc from inside the sandbox. Backends whose processes are host
        processes we own (bwrap) override this with a host-side walk that needs no fork inside.
        """
        from tmax_jax.sandbox.shell import descendants_started_after

        got = self._run(
            ["/bin/sh", "-c", "/bin/cat /proc/[0-9]*/stat 2>/dev/null; true"],
            timeout=15,
            stdin=None,
            env=None,
            cwd="/",
            cap=16 << 20,
            internal=True,
        )
        pids = descendants_started_after(got.stdout.decode(errors="replace"), session.shell_pid_inside, since)
        if pids:
            self._run(
                ["/bin/kill", "-9", *map(str, pids)],
                timeout=15,
                stdin=None,
                env=None,
                cwd="/",
                cap=1 << 16,
                internal=True,
            )

    def run_verifier(
        self,
        tests_dir: Path,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        private: bool = False,
    ) -> VerifierRun:
        """Run a verifier the agent cannot reach, over the agent's current filesystem.

        ``tests_dir`` (a host directory) appears at ``/tests`` and an empty ``/logs/verifier`` is
        created, both only in the verifier's own mount namespace (on a tmpfs of the task's storage
        size where the backend can), beside ``/tmp``, ``/var/tmp`` and ``/dev/shm`` of its own; agent
        processes can neither see them nor see or signal the verifier's processes. In
        ``cfg.verifier_mode`` ``strict`` the agent's processes are stopped first and the verifier
        has a network namespace of its own; in ``harbor`` they keep running (services the tests
        talk to) and it joins the agent's network. ``argv`` runs with ``VERIFIER_ENV`` (plus ``env``)
        in ``/tests``.
        ``private``: /tests is mode 0700 for the verifier's root, so that what its tests run as
        another user (the agent's code, graded unprivileged) cannot read the tests' cases.
        """
        raise SandboxError(f"the {self.backend} backend cannot run an isolated verifier")

    def _on_kill_shell(self, session) -> None:
        """Kill a whole shell session inside the sandbox (backends with container-side processes)."""
        return None

    # ---- backend hooks ---------------------------------------------------------------------------
    @abc.abstractmethod
    def _start(self) -> None: ...

    @abc.abstractmethod
    def _exec_argv(
        self, argv: list[str], env: dict[str, str], cwd: str, interactive: bool, internal: bool = False
    ) -> list[str]:
        """Host argv that runs ``argv`` inside the sandbox with exactly ``env`` and ``cwd``."""

    def _on_kill(self, proc) -> None:
        """Kill what the host process tree does not own (container-side processes)."""
        return None

    @abc.abstractmethod
    def _alive(self) -> bool: ...

    @abc.abstractmethod
    def _close(self) -> None: ...


def _absolute(p: str) -> str:
    if not str(p).startswith("/"):
        raise SandboxError(f"remote path must be absolute, got {p!r}")
    return str(PurePosixPath(p))
