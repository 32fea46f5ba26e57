"""bubblewrap backend: one long-lived namespace set per sandbox, commands enter it with nsenter.

The sandbox is a ``bwrap`` process (pid 1 of a new pid namespace, ``--die-with-parent``) that holds
mount/net/pid/ipc/uts/cgroup namespaces open. Every ``exec`` and shell joins those namespaces with
``nsenter`` and drops all capabilities with ``setpriv`` before running, so files, background
services and loopback ports are shared across commands, as in a container. When pid 1 dies the
kernel kills every process of the namespace; the per-sandbox cgroup is the second line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tmax_jax.errors import SandboxError
from tmax_jax.sandbox import cgroup, rootfs
from tmax_jax.sandbox.base import BASE_PATH, Sandbox
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.procs import kill_tree, pid_alive


@dataclass(frozen=True)
class BwrapImage:
    """What a bwrap sandbox starts from: a rootfs spec plus an optional prepared layer.

    layer: a directory whose ``fs/`` mirrors the writable paths (e.g. ``fs/app/...``), copied into
    each sandbox's private state; ``env``/``workdir`` come from the Dockerfile or setup recipe.
    """

    rootfs: str = "host"
    layer: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None


def bwrap_available() -> bool:
    return shutil.which("bwrap") is not None and shutil.which("nsenter") is not None


class BwrapSandbox(Sandbox):
    backend = "bwrap"

    def __init__(self, cfg: SandboxConfig, image: BwrapImage | None = None):
        image = image or BwrapImage(rootfs=cfg.rootfs)
        super().__init__(cfg, env=image.env, workdir=image.workdir)
        self.image = image
        self.rootfs = rootfs.resolve(
            image.rootfs if image.rootfs != "host" else cfg.rootfs, cfg.writable_paths
        )
        self.state = self.run_dir / "state"
        self.is_root = os.geteuid() == 0
        self.cg: cgroup.Cgroup | None = None
        self.init: subprocess.Popen | None = None
        self.child_pid: int | None = None

    def _owner_extra(self) -> dict:
        return {"cgroup": self.cg.name if self.cg else None}

    # ---- start -----------------------------------------------------------------------------------
    def _start(self) -> None:
        if not bwrap_available():
            raise SandboxError(
                "bwrap backend needs the 'bwrap' and 'nsenter' binaries (apt install bubblewrap util-linux)"
            )
        cfg = self.cfg
        if cfg.use_cgroups and cgroup.available():
            self.cg = cgroup.Cgroup(self.id)
            self.cg.create(pids_max=cfg.pids_max, memory_mb=cfg.memory_mb, cpus=cfg.cpus)
            self._write_owner()
        self.state.mkdir()
        if self.is_root:
            # A size-limited tmpfs makes the disk limit hold for every writable path at once.
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={cfg.disk_mb}m,mode=0755", "tmpfs", str(self.state)],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                raise SandboxError(f"could not mount the state tmpfs: {r.stderr.strip()}")
        for w in cfg.writable_paths:
            (self.state / w.lstrip("/")).mkdir(parents=True, exist_ok=True)
        if self.image.layer is not None:
            src = Path(self.image.layer) / "fs"
            if src.is_dir():
                r = subprocess.run(
                    ["cp", "-a", "--reflink=auto", f"{src}/.", f"{self.state}/"],
                    capture_output=True,
                    text=True,
                )
                if r.returncode != 0:
                    raise SandboxError(f"copying layer {self.image.layer} failed: {r.stderr.strip()[-500:]}")
        args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        if cfg.network:
            args.append("--share-net")
        if not self.is_root:
            args += ["--unshare-user", "--uid", "0", "--gid", "0"]
        args += ["--hostname", "tmax-sandbox"]
        args += list(self.rootfs.args)
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/shm"]
        args += ["--size", str(cfg.disk_mb << 20), "--tmpfs", "/tmp", "--tmpfs", "/run"]
        for w in sorted(cfg.writable_paths, key=lambda p: p.count("/")):
            args += ["--bind", str(self.state / w.lstrip("/")), w]
        args += list(self.rootfs.late_args)
        # bwrap's own root is a tmpfs holding the symlinks and mount points: make it read-only too.
        args += ["--remount-ro", "/"]
        r_fd, w_fd = os.pipe()
        # The info fd is written before the mounts are done; the "ready" line comes after them.
        args += ["--info-fd", str(w_fd), "--", "/bin/sh", "-c", "echo tmax-ready; exec sleep infinity"]
        try:
            self.init = subprocess.Popen(
                self._host_prefix() + args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(w_fd,),
                start_new_session=True,
            )
        finally:
            os.close(w_fd)
        info = b""
        with os.fdopen(r_fd, "rb") as f:
            info = f.read()  # bwrap closes the fd once the sandbox is set up (or on failure)
        try:
            self.child_pid = int(json.loads(info)["child-pid"])
        except (ValueError, KeyError) as e:
            err = self.init.stderr.read().decode(errors="replace") if self.init.poll() is not None else ""
            raise SandboxError(f"bwrap failed to start: {err.strip() or info!r}") from e
        ready = self.init.stdout.readline()
        self.init.stdout.close()
        if ready.strip() != b"tmax-ready":
            err = self.init.stderr.read().decode(errors="replace") if self.init.poll() is not None else ""
            raise SandboxError(f"bwrap sandbox did not come up: {err.strip() or ready!r}")

    def _host_prefix(self) -> list[str]:
        """Join the sandbox cgroup, then set rlimits, then exec the rest (children inherit both)."""
        cfg = self.cfg
        prefix: list[str] = []
        if self.cg is not None:
            files = self.cg.procs_files
            prefix = [
                "/bin/sh",
                "-c",
                'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"',
                "tmax-cg",
                str(len(files)),
                *files,
            ]
        limits = [f"--nofile={cfg.nofile}", f"--fsize={cfg.disk_mb << 20}"]
        if self.cg is None:
            limits += [f"--nproc={cfg.pids_max}", f"--as={cfg.memory_mb << 20}"]
        return prefix + ["prlimit", *limits, "--"]

    # ---- commands --------------------------------------------------------------------------------
    def _backend_env(self) -> dict[str, str]:
        out = dict(self.rootfs.env)
        if self.rootfs.path_prefix:
            out["PATH"] = ":".join(self.rootfs.path_prefix) + ":" + BASE_PATH
        return out

    def _exec_argv(self, argv: list[str], env: dict[str, str], cwd: str, interactive: bool) -> list[str]:
        if self.child_pid is None or not self._alive():
            raise SandboxError(f"sandbox {self.id} is not running")
        ns = ["nsenter", "-t", str(self.child_pid), "-m", "-u", "-i", "-n", "-p", "-C", "-r"]
        if not self.is_root:
            ns.insert(3, "-U")
            ns.insert(4, "--preserve-credentials")
        drop = ["/usr/bin/setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"]
        envv = ["/usr/bin/env", "-i", "-C", cwd, *(f"{k}={v}" for k, v in env.items())]
        return self._host_prefix() + ns + ["--"] + drop + envv + argv

    def shell_mark(self, session):
        # The shell's current descendants (earlier background jobs), found on the host side.
        from tmax_jax.sandbox.procs import descendants

        if getattr(session, "_host_shell_pid", None) is None:
            session._host_shell_pid = _host_pid_of(session.proc.pid, session.shell_pid_inside)
        if session._host_shell_pid is None:
            return set()
        return set(descendants(session._host_shell_pid))

    def kill_command_processes(self, session, since) -> None:
        # Host-side walk: works even when a fork bomb leaves no pid free inside the sandbox.
        from tmax_jax.sandbox.procs import descendants, parent_map

        shell_pid = getattr(session, "_host_shell_pid", None)
        if shell_pid is None:
            return
        for _ in range(3):
            pmap = parent_map()
            victims = [p for p in descendants(shell_pid, pmap) if p not in since]
            if not victims:
                return
            for p in victims:
                try:
                    os.kill(p, 9)
                except OSError:
                    pass
            time.sleep(0.01)

    def _alive(self) -> bool:
        return (
            self.init is not None
            and self.init.poll() is None
            and self.child_pid is not None
            and pid_alive(self.child_pid)
        )

    # ---- close -----------------------------------------------------------------------------------
    def _close(self) -> None:
        if self.cg is not None:
            self.cg.kill_all()
        if self.init is not None:
            kill_tree(self.init.pid)
            try:
                self.init.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if self.init.stderr:
                self.init.stderr.close()
        if self.child_pid is not None:
            # pid 1 of the namespace lingers in the kernel until every member is reaped.
            deadline = time.monotonic() + 10.0
            while pid_alive(self.child_pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        if self.cg is not None:
            self.cg.kill_all()
            self.cg.remove()

    def memory_peak_bytes(self) -> int | None:
        return self.cg.memory_peak_bytes() if self.cg else None


def _host_pid_of(root: int, ns_pid: int | None) -> int | None:
    """The host pid, among ``root`` and its descendants, whose innermost-namespace pid is ``ns_pid``."""
    from tmax_jax.sandbox.procs import descendants

    for p in [root, *descendants(root)]:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == ns_pid:
                            return p
                        break
        except (OSError, ValueError):
            continue
    return None
