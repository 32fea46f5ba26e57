"""Podman backend: one long-lived container per sandbox (``sleep infinity``), ``podman exec`` per command.

Isolation (rootful podman, runc): the container has its own user namespace (``--uidmap`` of root to
host uid 100000 and up, so container root owns nothing on the host), Docker's default capabilities
only (``--cap-drop=ALL`` then ``--cap-add``, inside that namespace), ``no-new-privileges``, and a
seccomp profile made from podman's default with mount/umount, ptrace, the keyring, bpf,
perf_event_open, io_uring, setns/unshare and namespace flags of clone, kexec, module loading and
file handles denied (``seccomp_profile``). podman keeps ``/proc/sys`` read-only and masks
``/proc/keys`` and friends; pid 1 starts with the image's environment only; ``/dev`` and ``/dev/shm``
are size-limited tmpfs; pids/memory/CPU limits per container; ``RLIMIT_FSIZE`` caps one file at
``disk_mb``. ``close`` removes the container, which kills every process in its PID namespace.
Not isolated: the writable root filesystem's total size (an overlay on the host disk, as under
Docker), and, in ``harbor`` verifier mode, loopback/abstract sockets between the agent and the
verifier (they share a network namespace on purpose).

Verification (``run_verifier``): a second container, started for it, with its own PID, mount, IPC and
user namespace and cgroup, its own empty ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (size-limited
tmpfs), and the agent's live root filesystem as its root (``--rootfs`` on the overlay's merged dir,
so the agent's files are seen as they are). In ``harbor`` verifier mode it joins the agent's network
namespace (``--network container:<agent>``: services the agent left running answer); in ``strict``
(the default) every agent process but the container's init and ``sleep`` is killed first and the
verifier has a network of its own. ``/tests`` (a private copy of the task's tests, writable like
Harbor's) and ``/logs/verifier`` (an empty dir) are bind mounts of that container only, from a tmpfs
of the task's storage size in the run dir; the reward files are read from there. Agent processes keep running and
may still rewrite their own files while the tests run, as under Docker, but cannot see or signal
the verifier's processes nor reach its ``/tests`` and ``/logs/verifier``: in the agent's namespace
both paths are empty read-only mounts, so the agent cannot rename them away (which would detach the
verifier's mounts) or put a symlink there. The verifier starts with ``VERIFIER_ENV`` (fixed PATH,
``HOME=/tests``, isolated Python start-up) in ``/tests``. What stays possible: agent code that the
tests themselves import runs inside the verifier (as under Harbor). ``podman_read_only`` sandboxes keep the
agent's writes in tmpfs of its own mount namespace, so they cannot be verified (a clear error).

Toolchain tampering is detected, not prevented (the agent's root filesystem is writable, as under
Docker, and the verifier must see what the agent installed): ``podman_toolchain`` scans the
overlay's upper dir before and after the verifier and watches its toolchain dirs with inotify while
it runs; any change to the interpreter, bash, pytest, site customisation, loader configuration or
the commands on the verifier's PATH sets ``VerifierRun.tampered`` (scored 0 by the runner).

Other flags that matter on these machines: ``--runtime runc`` (crun fails on hybrid cgroups) and
explicit ``--ulimit nofile/nproc`` (runc cannot raise the defaults here). Container-side processes
are not our children, so each command carries a ``TMAX_EXEC_ID`` in its environment and a kill finds
them by it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from tmax_jax.errors import SandboxError
from tmax_jax.sandbox import link_scan, overlay, podman_toolchain, seccomp, verifier_guard
from tmax_jax.sandbox.base import (
    VERIFIER_ENV,
    VERIFIER_PYTHON_REL,
    Sandbox,
    VerifierRun,
    exec_result,
    read_verifier_logs,
    stage_tests,
    write_verifier_python,
)
from tmax_jax.sandbox.config import ExecResult, SandboxConfig
from tmax_jax.sandbox.podman_images import PodmanImage, ensure_base_image
from tmax_jax.sandbox.procs import children, kill_tree, run_capped, stop_pid_namespace, tool_env

# Container uid/gid 0..65535 are host ids 100000..165535: no host file or process belongs to them.
ID_BASE = 100000
ID_COUNT = 65536
DOCKER_CAPS = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "NET_BIND_SERVICE",
    "NET_RAW",
    "SYS_CHROOT",
    "MKNOD",
    "AUDIT_WRITE",
    "SETFCAP",
)
# The bwrap backend's list (seccomp.DENIED), plus what podman's default profile lets through besides.
SECCOMP_DENY = tuple(
    sorted(set(seccomp.DENIED) | {"umount", "process_madvise", "fanotify_init", "clock_settime64", "stime"})
)
# clone(2) with a namespace flag fails with EPERM (as under bwrap); clone3 cannot be filtered by its
# flags (they are in memory), so it fails with ENOSYS and glibc falls back to clone.
_CLONE_NS_FLAGS = (
    0x00000080,
    0x00020000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
PODMAN_SECCOMP = Path("/usr/share/containers/seccomp.json")
SHM_MB = 64
VERIFY_LOG_CAP = 4 << 20


def _tighten(base: dict) -> dict:
    deny = set(SECCOMP_DENY) | {"clone", "clone3"}
    rules = []
    for rule in base.get("syscalls", []):
        names = [n for n in rule.get("names", []) if n not in deny]
        if names:
            rules.append({**rule, "names": names})
    rules.append({"names": sorted(SECCOMP_DENY), "action": "SCMP_ACT_ERRNO", "errnoRet": 1})
    ns = sum(_CLONE_NS_FLAGS)
    rules.append(
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": ns, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
        }
    )
    for flag in _CLONE_NS_FLAGS:
        rules.append(
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": 1,
                "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
            }
        )
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38})
    return {**base, "syscalls": rules}


_PROFILES: dict[str, Path] = {}


def seccomp_profile(cache_dir: str | os.PathLike) -> Path:
    """Our seccomp profile (podman's default, tightened), written once per content under
    ``<cache_dir>/podman/`` (a lock and an atomic rename: concurrent starters never read half a file)."""
    done = _PROFILES.get(str(cache_dir))
    if done is not None and done.is_file():
        return done
    if not PODMAN_SECCOMP.is_file():
        raise SandboxError(f"podman's default seccomp profile {PODMAN_SECCOMP} is missing; cannot build ours")
    data = json.dumps(_tighten(json.loads(PODMAN_SECCOMP.read_text())), indent=1, sort_keys=True).encode()
    out_dir = Path(cache_dir) / "podman"
    out = out_dir / f"seccomp-{hashlib.sha256(data).hexdigest()[:16]}.json"
    if out.is_file() and out.read_bytes() == data:
        _PROFILES[str(cache_dir)] = out
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".seccomp.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out.is_file() and out.read_bytes() == data):
            fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".seccomp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
    _PROFILES[str(cache_dir)] = out
    return out


def security_args(cfg: SandboxConfig) -> list[str]:
    """The flags both the agent's and the verifier's containers run with."""
    return [
        "--runtime", cfg.podman_runtime,
        f"--uidmap=0:{ID_BASE}:{ID_COUNT}", f"--gidmap=0:{ID_BASE}:{ID_COUNT}",
        "--cap-drop=ALL", f"--cap-add={','.join(DOCKER_CAPS)}",
        "--security-opt=no-new-privileges",
        # podman would copy the proxy variables of its own environment (credentials included).
        "--http-proxy=false",
        f"--security-opt=seccomp={seccomp_profile(cfg.cache_dir)}",
        f"--ulimit=nofile={cfg.nofile}:{cfg.nofile}", "--ulimit=nproc=4096:4096",
        f"--ulimit=fsize={cfg.disk_mb << 20}:{cfg.disk_mb << 20}",
        f"--pids-limit={cfg.pids_max}", f"--memory={cfg.memory_mb}m", f"--memory-swap={cfg.memory_mb}m",
        f"--cpus={cfg.cpus}", f"--shm-size={SHM_MB}m",
    ]  # fmt: skip


def _pids_with_env(marker: str) -> list[int]:
    needle = marker.encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(name))
        except OSError:
            continue
    return out


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, gid)


class PodmanSandbox(Sandbox):
    backend = "podman"

    def __init__(self, cfg: SandboxConfig, image: PodmanImage | str | None = None):
        if isinstance(image, str):
            image = PodmanImage(image)
        super().__init__(cfg, env=None, workdir=(image.workdir if image else None))
        self.image = image
        self.user = image.user if image else None
        self.name = f"tmax-{self.id}"
        self._layers: tuple[str, str, list[str]] | None = None
        self._verifies = 0
        self._holder: frozenset[int] = frozenset()

    def _owner_extra(self) -> dict:
        return {"container": self.name}

    def _start(self) -> None:
        cfg = self.cfg
        tag = self.image.tag if self.image else ensure_base_image(cfg)
        args = [
            "podman", "run", "-d", "--name", self.name,
            "--label", f"tmax-jax.owner={os.getpid()}",
            *security_args(cfg),
            "--network", "slirp4netns" if cfg.network else "none",
            "--hostname", "tmax-sandbox",
            "--init",  # catatonit as pid 1 reaps what a kill orphans
            # podman would create a missing image WORKDIR as host root (nobody inside, unwritable
            # under the uid map); the mkdir below makes it as the container's root instead.
            "--workdir", "/",
        ]  # fmt: skip
        if cfg.podman_read_only:
            # podman's own read-only tmpfs have no size: mount sized ones instead.
            args += ["--read-only", "--read-only-tmpfs=false"]
            for p in ("/tmp", "/var/tmp", "/run"):
                args += ["--tmpfs", f"{p}:rw,size={cfg.disk_mb}m,mode=1777"]
        # The verifier's mount points, held by empty read-only mounts in the agent's namespace: a
        # mount point cannot be renamed or removed there, so the agent can neither detach the
        # verifier's mounts (rename or unlink detaches a mount of another namespace) nor plant a
        # symlink at their place. /tmp stays on the root filesystem (as under Docker) for the
        # verifier to see.
        for p in ("/tests", "/logs/verifier"):
            args += ["--tmpfs", f"{p}:ro,size=4k,mode=0555"]
        args += [tag, "sleep", "infinity"]
        r = subprocess.run(args, capture_output=True, env=tool_env(), text=True, timeout=300)
        if r.returncode != 0:
            raise SandboxError(f"podman run failed: {r.stderr.strip()[-800:]}")
        # /tmp is sticky and world-writable as in Docker images (the host-built base has it 0755).
        setup = 'mkdir -p "$1" && if [ "$(stat -c %a /tmp)" = 755 ]; then chmod 1777 /tmp; fi'
        r = subprocess.run(
            ["podman", "exec", self.name, "/bin/sh", "-c", setup, "sh", self.workdir],
            capture_output=True,
            env=tool_env(),
            text=True,
            timeout=120,
        )
        if r.returncode != 0:
            hint = " (podman_read_only: the image must have the workdir)" if cfg.podman_read_only else ""
            raise SandboxError(f"podman sandbox setup failed{hint}: {r.stderr.strip()[-500:]}")
        # The container's init and its ``sleep`` (host pids), spared by a strict verifier's stop of
        # the agent's processes.
        r = self._inspect("{{.State.Pid}}")
        try:
            init = int(r.stdout.strip())
        except ValueError:
            raise SandboxError(
                f"podman sandbox {self.name}: no init pid ({r.stderr.strip()[-300:]})"
            ) from None
        self._holder = frozenset({init, *children(init)})

    def host_env(self) -> dict[str, str]:
        return tool_env()

    def environment(self, env=None) -> dict[str, str]:
        # The image's own ENV (PATH, ...) stays; only add what the caller and config ask for.
        out = {"TERM": "dumb", "LANG": "C.UTF-8", "HOME": "/root"}
        if self.user is not None:  # podman runs it as the image's USER, with that user's HOME
            del out["HOME"]
            name = self.user.partition(":")[0]
            if not name.isdigit():
                out["USER"] = name
        out.update(dict(self.cfg.env))
        out.update(env or {})
        return out

    def _exec_argv(
        self, argv: list[str], env: dict[str, str], cwd: str, interactive: bool, internal: bool = False
    ) -> list[str]:
        host = ["podman", "exec"]
        if interactive:
            host.append("-i")
        if internal:  # the runner's own commands (file transfer) as root, whatever the image's USER
            host += ["--user", "0:0"]
        host += ["-w", cwd, "-e", f"TMAX_EXEC_ID={uuid.uuid4().hex}"]
        for k, v in env.items():
            host += ["-e", f"{k}={v}"]
        return host + [self.name, *argv]

    def _on_kill(self, proc) -> None:
        marker = next(
            (a.split("=", 1)[1] for a in proc.args if isinstance(a, str) and a.startswith("TMAX_EXEC_ID=")),
            None,
        )
        if marker:
            for p in _pids_with_env(f"TMAX_EXEC_ID={marker}"):
                kill_tree(p, sig=signal.SIGKILL)

    def _on_kill_shell(self, session) -> None:
        # Only the shell and its descendants: a service the agent double-forked must survive the
        # shell, as it does on bwrap (the env-marker kill would find it too).
        if session.shell_pid_inside is None or self._closed:
            return
        try:
            self.kill_command_processes(session, 0)
            self._run(
                ["/bin/kill", "-9", str(session.shell_pid_inside)],
                timeout=15,
                stdin=None,
                env=None,
                cwd="/",
                cap=1 << 16,
            )
        except Exception:  # noqa: BLE001 - the container may be gone already
            self._on_kill(session.proc)

    # ---- verification ----------------------------------------------------------------------------
    def layers(self) -> tuple[str, str, list[str]]:
        """(merged dir, upper dir, image layer dirs) of the agent container's overlay, on the host."""
        if self._layers is None:
            fmt = "{{.GraphDriver.Name}}\n{{.GraphDriver.Data.MergedDir}}\n{{.GraphDriver.Data.UpperDir}}\n{{.GraphDriver.Data.LowerDir}}"
            r = self._inspect(fmt)
            lines = r.stdout.split("\n")
            if r.returncode != 0 or len(lines) < 4 or lines[0] != "overlay" or not lines[1] or not lines[2]:
                raise SandboxError(
                    f"podman sandbox {self.name}: cannot verify without an overlay root filesystem "
                    f"(driver {lines[0] if lines else '?'!r}): {r.stderr.strip()[-300:]}"
                )
            self._layers = (lines[1], lines[2], podman_toolchain.lower_dirs(lines[3]))
        return self._layers

    def run_verifier(
        self,
        tests_dir: Path,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        private: bool = False,
    ) -> VerifierRun:
        tests_dir = Path(tests_dir)
        if not tests_dir.is_dir():
            raise SandboxError(f"run_verifier: tests dir {tests_dir} is not a directory")
        if not argv:
            raise SandboxError("run_verifier: empty command")
        if self.cfg.podman_read_only:
            # The agent's only writable dirs are then tmpfs of its own mount namespace.
            raise SandboxError(
                "run_verifier: podman_read_only sandboxes keep the agent's files where no verifier sees them"
            )
        limit = self.clamp_timeout(timeout)
        merged, upper, lowers = self.layers()
        if self.cfg.verifier_mode == "strict" and not (
            self._holder and stop_pid_namespace(min(self._holder), self._holder)
        ):
            why = "the agent's processes could not be stopped before the tests"
            return VerifierRun(ExecResult("", f"verifier not run: {why}\n", 1), {}, why)
        self._verifies += 1
        vname = f"{self.name}-verify-{self._verifies}"
        # A tmpfs of the task's storage size: what the tests leave in /tests and /logs neither fills
        # the host's disk nor outlives the verification (an unmount removes it at once).
        vdir = self.run_dir / f"verify-{self._verifies}"
        tests, logs = vdir / "tests", vdir / "logs"
        try:
            stage_tests(vdir, tests_dir, self.cfg.disk_mb, ID_BASE)
            env = verifier_guard.merge_env(write_verifier_python(tests), dict(env or {}))
            logs.mkdir()
            guard = vdir / "guard"
            guard.mkdir()
            # Owned by the container's root (a mapped uid), so that the verifier may write both.
            _chown_tree(vdir, ID_BASE, ID_BASE)
            tests.chmod(0o700 if private else 0o755)
            watch = podman_toolchain.Watch(upper).start()
            try:
                links = link_scan.LinkWatch([(upper, ())], self._view_host(merged)).start()
            except BaseException:
                watch.stop()
                raise
            try:
                before = (
                    podman_toolchain.scan(upper, lowers, tests)
                    or podman_toolchain.shadow_scan(upper)
                    or self._link_scan(merged, upper)
                )
                result = (
                    ExecResult("", f"verifier not run: {before}\n", 1)
                    if before
                    else self._run_verifier_container(vname, merged, tests, logs, argv, env, limit)
                )
            finally:
                during = [watch.stop(), links.stop()]  # both, always: each holds a thread and an fd
            tampered = (
                before
                or during[0]
                or during[1]
                or podman_toolchain.scan(upper, lowers, tests)
                or podman_toolchain.shadow_scan(upper)
                or self._link_scan(merged, upper)
            )
            if before:
                return VerifierRun(result, {}, tampered)
            guarded, suspect = verifier_guard.read_records(guard)
            tampered = tampered or guarded or verifier_guard.reward_files_problem(logs)
            return VerifierRun(result, read_verifier_logs(logs, VERIFY_LOG_CAP), tampered, suspect)
        finally:
            if not overlay.remove_unmounted_tree(vdir):
                self._left_behind = True  # the run dir's removal at close tries again

    @staticmethod
    def _view_host(merged: str) -> link_scan.HostOf:
        return lambda parts: os.path.join(merged, *parts)

    def _link_scan(self, merged: str, upper: str) -> str | None:
        """A link the agent made (its layer) that leads the verifier into its own files, as a reason."""
        return link_scan.find_link_into_verifier([(upper, ())], self._view_host(merged))

    def _verifier_network(self) -> str:
        """harbor: the agent's network namespace (its services answer the tests); strict: one of
        the verifier's own, loopback only unless the task has a link out."""
        if self.cfg.verifier_mode == "harbor":
            return f"container:{self.name}"
        return "slirp4netns" if self.cfg.network else "none"

    def _run_verifier_container(self, vname, merged, tests, logs, argv, env, limit) -> ExecResult:
        full_env = {**VERIFIER_ENV, **(env or {})}
        args = [
            "podman", "run", "--rm", "--name", vname,
            "--label", f"tmax-jax.owner={os.getpid()}",
            *security_args(self.cfg),
            "--network", self._verifier_network(),
            "--hostname", "tmax-sandbox",
            # Scratch of its own, empty (podman would copy the dir it covers up into it by default;
            # ``/dev/shm`` is its own already: ``--shm-size``).
            "--tmpfs", f"/tmp:rw,size={self.cfg.disk_mb}m,mode=1777,notmpcopyup",
            "--tmpfs", f"/var/tmp:rw,size={self.cfg.disk_mb}m,mode=1777,notmpcopyup",
            # A hard stop that holds even if this process dies mid-verification.
            f"--timeout={math.ceil(limit) + 30}",
            "-v", f"{tests}:/tests", "-v", f"{logs}:/logs/verifier",
            "-v", f"{Path(logs).parent / 'guard'}:{verifier_guard.GUARD_DIR}",
            "-w", "/tests",
        ]  # fmt: skip
        # The tests' own files and the verifier's Python, read-only (``verifier_guard``).
        for rel in verifier_guard.readonly_test_files(tests, VERIFIER_PYTHON_REL):
            args += ["-v", f"{tests / rel}:/tests/{rel}:ro"]
        for k, v in full_env.items():
            args += ["-e", f"{k}={v}"]
        args += ["--rootfs", merged, *argv]

        def kill(_proc) -> None:
            subprocess.run(
                ["podman", "rm", "-f", "-i", "-t", "0", vname],
                capture_output=True,
                env=tool_env(),
                timeout=60,
            )

        cap = self.cfg.max_output_bytes
        got = run_capped(args, timeout=limit, cap=cap, env=tool_env(), on_kill=kill)
        self.exec_durations.append(got.duration_s)
        if got.timed_out or got.truncated:
            kill(None)
        return exec_result(got, cap)

    # ---- lifecycle -------------------------------------------------------------------------------
    def _inspect(self, fmt: str) -> subprocess.CompletedProcess:
        """``podman inspect -f FMT`` of the agent's container (text; the caller checks the status)."""
        return subprocess.run(
            ["podman", "inspect", "-f", fmt, self.name],
            capture_output=True,
            env=tool_env(),
            text=True,
            timeout=60,
        )

    def _alive(self) -> bool:
        r = self._inspect("{{.State.Running}}")
        return r.returncode == 0 and r.stdout.strip() == "true"

    def _close(self) -> None:
        names = [self.name] + [f"{self.name}-verify-{i}" for i in range(1, self._verifies + 1)]
        for _ in range(2):
            r = subprocess.run(
                ["podman", "rm", "-f", "-i", "-t", "0", *names],
                capture_output=True,
                env=tool_env(),
                timeout=120,
            )
            if r.returncode == 0:
                break
