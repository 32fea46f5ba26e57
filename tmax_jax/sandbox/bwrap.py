"""bubblewrap backend: a user namespace of its own per sandbox, a bwrap per command, a verifier apart.

Layout of one sandbox (the threat model is in sandboxes/README.md):

- A user namespace ``U`` whose root is an unprivileged host uid (as host root: uids 0..65535 inside
  map to ``SUBID_BASE`` and up; as an ordinary user: the user itself). Host files owned by host root
  are ``nobody`` inside, so no capability held in ``U`` reaches them.
- A holder: ``bwrap`` as pid 1 of a new pid namespace, with new network, IPC, UTS and cgroup
  namespaces, all owned by ``U``; it runs ``sleep`` and reaps orphans. It keeps the namespaces alive.
- Every command (``exec``, each shell) is its own ``bwrap`` that joins ``U``, the network, IPC, UTS
  and cgroup namespaces (``nsenter``) and the holder's pid namespace (``--pidns``), builds a fresh
  mount namespace (the sandbox's writable state as its root, the base over it), keeps Docker's
  default capabilities (within ``U`` only) and runs under the seccomp filter of ``seccomp.py``.
  All writable paths, ``/tmp``, ``/run`` and ``/dev/shm`` included, are directories of one
  size-limited state tmpfs, so every command sees the same files, as in a container.
- As host root, the base's top-level dirs (``/usr``, ``/etc``, ...) are copy-on-write overlays
  (``overlay.py``): id-mapped so that the sandbox's root owns them there, changes in the state's
  disk, mounted once and bound into every command. Otherwise (an ordinary user) they are read-only.
- The verifier (``run_verifier``) is a ``bwrap`` that joins only ``U`` and, in ``harbor`` mode,
  the network namespace (``strict``, the default, first kills every agent process of the pid
  namespace but the holder's own and gives the verifier a network namespace of its own): its pid
  namespace is a sibling of the agent's (agent processes cannot see or signal it) and its mount
  namespace has the base (the agent's copy-on-write view of it, as under Docker, its toolchain
  checked by ``podman_toolchain`` before, during and after; else freshly bound), the agent's other
  top-level dirs (and ``/var``'s entries), each bound from an fd opened without following links so
  that a dir swapped for a link after it was looked at cannot lead bwrap to a host path, its own
  size-limited ``/tmp``, ``/var/tmp`` and ``/dev/shm``, and ``/tests`` and ``/logs`` from a tmpfs of
  the task's storage size (as host root) that no agent mount namespace contains. The reward is read
  from that host directory; the tmpfs is unmounted after.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tmax_jax.errors import SandboxError
from tmax_jax.sandbox import cgroup, link_scan, overlay, podman_toolchain, rootfs, seccomp, verifier_guard
from tmax_jax.sandbox.base import (
    BASE_PATH,
    VERIFIER_PYTHON_REL,
    ExecResult,
    Sandbox,
    VerifierRun,
    exec_result,
    read_verifier_logs,
    stage_tests,
    write_verifier_python,
)
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.procs import children, kill_tree, pid_alive, run_capped, stop_pid_namespace

# Host uid/gid that root of a sandbox's user namespace maps to when tmax-jax runs as host root.
SUBID_BASE = 100000
SUBID_COUNT = 65536
# Docker's default capability set: root inside behaves as in a container, over the sandbox's own
# files only (capabilities of a user namespace do not apply to host-owned objects).
CAPS = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SYS_CHROOT",
    "CAP_MKNOD", "CAP_AUDIT_WRITE", "CAP_SETFCAP",
)  # fmt: skip
# Created in every sandbox's state, sticky and world-writable, as in a container.
SCRATCH = ("/tmp", "/run", "/run/lock", "/var/tmp")
# Top-level names a verifier never takes from the agent's state (its own mounts, or the kernel's).
_VERIFIER_OWN = frozenset({"proc", "dev", "sys", "tests", "logs", "tmp"})
# Where an agent's entry is bound from: an fd opened without following links (``_bind_entry``).
_O_ENTRY = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_O_LIST = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# As host root, each sandbox's host-side mounts (its state tmpfs, and read-only binds of bind sources
# that root of the user namespace could not reach, such as a Python under /root) live under here,
# in a directory only host root and the sandbox's root may enter.
STAGE_ROOT = Path("/run/tmax-jax")
# Joins the cgroup, opens the seccomp program (fd 3) and a pid namespace (fd 4), then execs the rest.
_PREFIX = (
    'exec 3<"$1" 4<"$2" || exit 125; shift 2; n=$1; shift; '
    'while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
)


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
    # The Dockerfile's final USER: the agent's commands run as it (the runner's own and the
    # verifier as root).
    user: str | None = None


def bwrap_available() -> bool:
    return all(shutil.which(b) is not None for b in ("bwrap", "nsenter", "unshare", "prlimit"))


class BwrapSandbox(Sandbox):
    backend = "bwrap"

    def __init__(self, cfg: SandboxConfig, image: BwrapImage | None = None):
        image = image or BwrapImage(rootfs=cfg.rootfs)
        super().__init__(cfg, env=image.env, workdir=image.workdir)
        self.image = image
        if image.user is not None and not _is_root_user(image.user):
            self.user = image.user
        self.rootfs = rootfs.resolve(
            image.rootfs if image.rootfs != "host" else cfg.rootfs, cfg.writable_paths
        )
        self.is_root = os.geteuid() == 0
        self.stage = STAGE_ROOT / self.id if self.is_root else self.run_dir
        # One size-limited disk per sandbox: the agent's root directory and /dev/shm's backing dir.
        self.disk = self.stage / "disk"
        self.state = self.disk / "root"
        self._shm = self.disk / "shm"
        self._staged: list[Path] = []
        self._base_args: tuple[str, ...] = ()
        self._late_args: tuple[str, ...] = ()
        self.cg: cgroup.Cgroup | None = None
        self.init: subprocess.Popen | None = None
        self.child_pid: int | None = None
        self._bpf = self.run_dir / "seccomp.bpf"
        self._verifications = 0
        self._holder: frozenset[int] = frozenset()
        # Copy-on-write base dirs (host root only): destination -> (base dir, merged mount point).
        self.overlays: dict[str, tuple[str, Path]] = {}
        self._upper = self.disk / "upper"
        self._work = self.disk / "work"
        self._mask = self.disk / "mask"
        self._ovl = self.stage / "ovl"

    def _owner_extra(self) -> dict:
        return {
            "cgroup": self.cg.name if self.cg else None,
            "stage": str(self.stage) if self.is_root else None,
        }

    # ---- ownership -------------------------------------------------------------------------------
    def _give_to_sandbox(self, path: Path) -> None:
        """Make host-created files under ``path`` belong to the sandbox's root (ids shifted into U)."""
        if not self.is_root:
            return
        for root, dirs, files in os.walk(path):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                st = os.lstat(name)
                uid = st.st_uid if st.st_uid >= SUBID_BASE else SUBID_BASE + min(st.st_uid, SUBID_COUNT - 1)
                gid = st.st_gid if st.st_gid >= SUBID_BASE else SUBID_BASE + min(st.st_gid, SUBID_COUNT - 1)
                if (uid, gid) != (st.st_uid, st.st_gid):
                    os.lchown(name, uid, gid)

    # ---- start -----------------------------------------------------------------------------------
    def _start(self) -> None:
        if not bwrap_available():
            raise SandboxError(
                "bwrap backend needs the 'bwrap', 'nsenter', 'unshare' and 'prlimit' binaries "
                "(apt install bubblewrap util-linux)"
            )
        cfg = self.cfg
        if cfg.use_cgroups and cgroup.available():
            self.cg = cgroup.Cgroup(self.id)
            self.cg.create(pids_max=cfg.pids_max, memory_mb=cfg.memory_mb, cpus=cfg.cpus)
            self._write_owner()
        if self.is_root:
            _make_stage_root()
            self.stage.mkdir(mode=0o700)
            os.chown(self.stage, SUBID_BASE, SUBID_BASE)
            self._write_owner()
        self.disk.mkdir()
        if self.is_root:
            # A size-limited tmpfs makes the disk limit hold for every writable path at once,
            # /tmp, /run and /dev/shm included; its root belongs to the sandbox's root.
            opts = f"size={cfg.disk_mb}m,mode=0755,uid={SUBID_BASE},gid={SUBID_BASE}"
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(self.disk)], capture_output=True, text=True
            )
            if r.returncode != 0:
                raise SandboxError(f"could not mount the state tmpfs: {r.stderr.strip()}")
        self.state.mkdir()
        for w in cfg.writable_paths:
            (self.state / w.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for d in [*(self.state / p.lstrip("/") for p in SCRATCH), self._shm]:
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o1777)
        for p in rootfs.SKELETON:  # the base image's empty directories and /run links
            (self.state / p.lstrip("/")).mkdir(mode=0o700 if p == "/root" else 0o755, exist_ok=True)
        for target, link in rootfs.SKELETON_LINKS:
            if not os.path.lexists(self.state / link.lstrip("/")):
                os.symlink(target, self.state / link.lstrip("/"))
        if self.is_root:
            self._plan_overlays()
        if self.image.layer is not None:
            src = Path(self.image.layer) / "fs"
            # The layer's copy of a base dir is an overlay's lower layer, not copied.
            names = sorted(n for n in os.listdir(src) if "/" + n not in self.overlays) if src.is_dir() else []
            if names:
                r = subprocess.run(
                    ["cp", "-a", "--reflink=auto", *(f"{src}/{n}" for n in names), f"{self.state}/"],
                    capture_output=True,
                    text=True,
                )
                if r.returncode != 0:
                    raise SandboxError(f"copying layer {self.image.layer} failed: {r.stderr.strip()[-500:]}")
        for dest, (src, _) in self.overlays.items():
            name = dest.lstrip("/")
            st = os.stat(src)
            for d in (self._upper / name, self._mask / name):
                d.mkdir(parents=True)
                os.chown(d, st.st_uid, st.st_gid)
                d.chmod(st.st_mode & 0o7777)
            (self._work / name).mkdir(parents=True)
            overlay.prepare_mask(self._mask / name, src, dest, self._layer_dir(dest))
        self._base_args = self._reachable(self.rootfs.args)
        self._late_args = self._reachable(self.rootfs.late_args)
        # Mount points in the state for binds of the base's own (the host Python's prefix under
        # /root), each dir on the way searchable by all, as the host's /usr is: bwrap would make the
        # missing ones 0700, and a verifier's unprivileged child (a grader running the agent's code
        # as 65534) could then import no module of the standard library it had not loaded already.
        for _, dest in _dests(self.rootfs.late_args):
            rel = PurePosixPath(dest).relative_to("/")
            for depth in range(2, len(rel.parts) + 1):
                d = self.state.joinpath(*rel.parts[:depth])
                if not os.path.lexists(d):
                    d.mkdir(mode=0o755)
                    d.chmod(0o755)
        # The state is the agent's root directory: the base's top-level symlinks (/bin -> usr/bin)
        # live in it, made once here (bwrap refuses to remake a symlink that exists).
        for target, dest in _symlinks(self._base_args):
            link = self.state / dest.lstrip("/")
            if not os.path.lexists(link):
                os.symlink(target, link)
        self._give_to_sandbox(self.disk)
        seccomp.write_program(self._bpf)
        self._start_holder()
        self._mount_overlays()

    # ---- copy-on-write base ----------------------------------------------------------------------
    def _plan_overlays(self) -> None:
        """Each top-level dir the base binds read-only becomes an overlay (see ``overlay.py``)."""
        args = self.rootfs.args
        for i in range(len(args) - 2):
            if args[i] == "--ro-bind" and args[i + 2].count("/") == 1 and os.path.isdir(args[i + 1]):
                self.overlays[args[i + 2]] = (args[i + 1], self._ovl / "merged" / args[i + 2].lstrip("/"))

    def _layer_dir(self, dest: str) -> Path | None:
        if self.image.layer is None:
            return None
        d = Path(self.image.layer) / "fs" / dest.lstrip("/")
        return d if d.is_dir() and not d.is_symlink() else None

    def _mount_overlays(self) -> None:
        if not self.overlays:
            return
        userns = f"/proc/{self.child_pid}/ns/user"
        for dest, (src, merged) in self.overlays.items():
            name = dest.lstrip("/")
            lower = self._ovl / "lower" / name
            lower.mkdir(parents=True)
            merged.mkdir(parents=True)
            try:
                overlay.idmapped_bind(src, str(lower), userns)
                layer = self._layer_dir(dest)
                lowers = [*([str(layer)] if layer is not None else []), str(self._mask / name), str(lower)]
                overlay.mount_overlay(lowers, self._upper / name, self._work / name, merged)
            except OSError as e:
                raise SandboxError(f"sandbox {self.id}: cannot make {dest} copy-on-write: {e}") from e

    def _lowers(self) -> list[str]:
        """The image under the agent's changes, as root-relative trees: the layer, then the base."""
        out = [str(Path(self.image.layer) / "fs")] if self.image.layer is not None else []
        return out + [self._base_root()]

    def _base_root(self) -> str:
        srcs = {src for src, _ in self.overlays.values()}
        roots = {str(Path(s).parent) for s in srcs}
        return roots.pop() if len(roots) == 1 else "/"

    def writable(self, path: str) -> bool:
        """Whether the agent can write ``path`` (absolute): anywhere but the kernel's dirs and the
        base dirs that are not copy-on-write (all of them when not running as host root)."""
        if any(path == d or path.startswith(d + "/") for d in ("/proc", "/dev", "/sys")):
            return False
        ro = [d for d in self.rootfs.read_only if d not in self.overlays]
        return not any(path == d or path.startswith(d.rstrip("/") + "/") for d in ro)

    def overlay_uppers(self) -> dict[str, Path]:
        """Destination -> the agent's copy-on-write dir of that base dir (what it changed there)."""
        return {dest: self._upper / dest.lstrip("/") for dest in self.overlays}

    def _with_overlays(self, args: tuple[str, ...] | list[str]) -> list[str]:
        """``args`` with the read-only binds of copy-on-write dirs replaced by their merged view."""
        out, i = [], 0
        while i < len(args):
            if args[i] == "--ro-bind" and i + 2 < len(args) and args[i + 2] in self.overlays:
                out += ["--bind", str(self.overlays[args[i + 2]][1]), args[i + 2]]
                i += 3
                continue
            out.append(args[i])
            i += 1
        return out

    def _reachable(self, args: tuple[str, ...]) -> tuple[str, ...]:
        """``args`` with each bind source that root of the user namespace cannot reach (a path
        under a directory closed to others, e.g. /root) replaced by a read-only bind in the stage."""
        out = list(args)
        for i, a in enumerate(out[:-2]):
            if a in ("--ro-bind", "--bind") and self.is_root and not _reachable_by_others(out[i + 1]):
                dst = self.stage / f"src{len(self._staged)}"
                dst.mkdir()
                try:  # read-only from the start: never a moment of the host's files writable here
                    overlay.readonly_bind(out[i + 1], str(dst))
                except OSError as e:
                    raise SandboxError(f"could not stage {out[i + 1]} for the sandbox: {e}") from e
                self._staged.append(dst)
                out[i + 1], out[i] = str(dst), "--ro-bind"
        return tuple(out)

    def _start_holder(self) -> None:
        userns_holder = None
        if self.is_root:
            # Host root may write any id map: give the sandbox a range of unprivileged host ids.
            userns_holder = subprocess.Popen(
                ["unshare", "--user", "--", "sleep", "infinity"],
                env={"PATH": BASE_PATH},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        try:
            if userns_holder is not None:
                self._spawn_holder(self._join_userns(userns_holder), [])
            else:
                self._spawn_holder([], ["--unshare-user", "--uid", "0", "--gid", "0"])
        finally:
            if userns_holder is not None:  # the holder's namespaces keep U alive from here on
                kill_tree(userns_holder.pid)
                userns_holder.wait()
                userns_holder.stderr.close()

    def _spawn_holder(self, enter: list[str], userns_args: list[str]) -> None:
        """Start pid 1 of the sandbox (``bwrap`` holding its namespaces) and wait until it is up."""
        args = [
            "bwrap",
            *userns_args,
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
        ]
        if not self.cfg.network:
            args.append("--unshare-net")
        args += ["--die-with-parent", "--new-session", "--hostname", "tmax-sandbox"]
        args += [*self._base_args, "--proc", "/proc", "--dev", "/dev", *self._late_args]
        args += ["--cap-drop", "ALL", "--clearenv", "--setenv", "PATH", BASE_PATH]
        r_fd, w_low = os.pipe()
        # Above the fds the prefix opens (3, 4), so they cannot clobber it.
        w_fd = fcntl.fcntl(w_low, fcntl.F_DUPFD, 10)
        os.close(w_low)
        # The info fd is written before the mounts are done; the "ready" line comes after them.
        args += ["--info-fd", str(w_fd), "--", "/bin/sh", "-c", "echo tmax-ready; exec sleep infinity"]
        with os.fdopen(r_fd, "rb") as info_pipe:
            try:
                # A clean environment: pid 1's /proc/1/environ is readable inside and must hold nothing.
                self.init = subprocess.Popen(
                    self._host_prefix(self.cg) + enter + args,
                    env={"PATH": BASE_PATH},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(w_fd,),
                    start_new_session=True,
                )
            finally:
                os.close(w_fd)
            info = info_pipe.read()  # bwrap closes the fd once the sandbox is set up (or on failure)
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
        # What holds the namespaces open (bwrap's init and its ``sleep``), spared by a strict
        # verifier's stop of the agent's processes.
        self._holder = frozenset({self.child_pid, *children(self.child_pid)})

    def _join_userns(self, holder: subprocess.Popen) -> list[str]:
        """Write the id maps of ``holder``'s new user namespace; the argv prefix that enters it as root."""
        ns = f"/proc/{holder.pid}/ns/user"
        deadline = time.monotonic() + 10.0
        while True:  # unshare(1) has created the namespace once its ns link differs from ours
            try:
                if os.readlink(ns) != os.readlink("/proc/self/ns/user"):
                    break
            except OSError:
                pass
            if holder.poll() is not None or time.monotonic() > deadline:
                err = holder.stderr.read().decode(errors="replace") if holder.poll() is not None else ""
                raise SandboxError(
                    f"could not create the sandbox's user namespace: {err.strip() or 'timeout'}"
                )
            time.sleep(0.001)
        mapping = f"0 {SUBID_BASE} {SUBID_COUNT}\n"
        try:
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{holder.pid}/{name}", "w") as f:
                    f.write(mapping)
        except OSError as e:
            raise SandboxError(f"could not map ids into the sandbox's user namespace: {e}") from e
        return ["nsenter", f"--user={ns}", "-S", "0", "-G", "0", "--"]

    def _host_prefix(self, cg: cgroup.Cgroup | None, pidns: str = "/dev/null") -> list[str]:
        """Join ``cg``, open the seccomp program (fd 3) and ``pidns`` (fd 4), set rlimits, exec the rest."""
        cfg = self.cfg
        files = cg.procs_files if cg is not None else []
        limits = [f"--nofile={cfg.nofile}", f"--fsize={cfg.disk_mb << 20}"]
        if cg is None:
            limits += [f"--nproc={cfg.pids_max}", f"--as={cfg.memory_mb << 20}"]
        bpf = str(self._bpf) if self._bpf.exists() else "/dev/null"
        return [
            "/bin/sh",
            "-c",
            _PREFIX,
            "tmax-exec",
            bpf,
            pidns,
            str(len(files)),
            *files,
            "prlimit",
            *limits,
            "--",
        ]

    def _enter(self, namespaces: tuple[str, ...]) -> list[str]:
        """nsenter into the holder's ``namespaces`` (user first), as root of the user namespace."""
        ns = ["nsenter", "-t", str(self.child_pid), *(f"--{n}" for n in namespaces)]
        ns += ["-S", "0", "-G", "0"] if self.is_root else ["--preserve-credentials"]
        return ns + ["--"]

    def _mount_tree(self) -> list[str]:
        """An agent command's mounts: the state as a writable root (any path outside the base can be
        created, as under Docker, within the disk limit), the base read-only over it, /proc with a
        read-only /proc/sys, a fresh /dev with /dev/shm from the state."""
        base = self._with_overlays(_without_symlinks(self._base_args))
        return ["--bind", str(self.state), "/", *base, *self._kernel_mounts(), *self._late_args]

    def _kernel_mounts(self, shm: list[str] | None = None) -> list[str]:
        """/proc (its /proc/sys read-only), a fresh /dev, and /dev/shm: the agent's (from its disk)
        unless ``shm`` gives the mount args of another."""
        shm = ["--bind", str(self._shm), "/dev/shm"] if shm is None else shm
        return ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev", *shm]

    def _scratch(self, dest: str) -> list[str]:
        """A verifier's own scratch dir at ``dest``: sticky, world-writable, size-limited tmpfs."""
        return ["--perms", "1777", "--size", str(self.cfg.disk_mb << 20), "--tmpfs", dest]

    def _verifier_tree(self, tests: Path, logs: Path, links: Path) -> tuple[list[str], list[int], list]:
        """A verifier's mounts and the fds they bind from: a read-only root of bwrap's own, the
        base's dirs (the agent's copy-on-write views of them, as under Docker, whose toolchain
        ``run_verifier`` checks; the rest bound afresh), each other top-level entry of the agent's
        state as it is now, its own scratch (``/tmp``, ``/var/tmp``, ``/dev/shm``), and ``/tests``,
        ``/logs`` of its own. Also returns the fds to pass and the links remade below the top
        (``(dest, target)``; the top-level ones go into the dir ``links``), for the link checks.

        The agent's entries are bound from fds opened without following links (``_bind_entry``):
        a dir swapped for a link after it was looked at cannot lead bwrap, which resolves paths on
        the host, to a host dir. The caller closes the fds."""
        base_names = {d.lstrip("/").split("/")[0] for _, d in _dests(self._base_args)}
        args = self._with_overlays(self._base_args)
        fds: list[int] = []
        nested: list[tuple[str, str]] = []
        try:
            root = os.open(self.state, _O_LIST)
        except OSError as e:
            raise SandboxError(f"sandbox {self.id}: cannot open its state: {e}") from e
        try:
            entries = sorted(os.listdir(root))
            for name in entries:
                # A pytest config or conftest.py linked in at the top is never made (``run_verifier``
                # scores it 0 when it sees one; this holds even if a process flips it in between).
                if name in base_names or name in _VERIFIER_OWN or name in podman_toolchain.ROOT_CONFIGS:
                    continue
                if name == "var" and self._var_tree(root, args, fds, nested):
                    continue
                args += self._bind_entry(root, name, f"/{name}", fds, links)
        except BaseException:
            _close_fds(fds)
            raise
        finally:
            os.close(root)
        args += self._scratch("/tmp")
        args += self._kernel_mounts(shm=self._scratch("/dev/shm"))
        args += ["--bind", str(tests), "/tests", "--bind", str(logs), "/logs"]
        # The tests' own files and the verifier's Python, read-only: code the tests run cannot
        # append to the test.sh that bash is still reading, nor change a plugin (``verifier_guard``).
        for rel in verifier_guard.readonly_test_files(tests, VERIFIER_PYTHON_REL):
            args += ["--ro-bind", str(tests / rel), f"/tests/{rel}"]
        # bwrap's own root holds only mount points and symlinks: read-only.
        return args + [*self._late_args, "--remount-ro", "/"], fds, nested

    def _bind_entry(
        self, dir_fd: int, name: str, dest: str, fds: list[int], links: Path | list, files: bool = False
    ) -> list[str]:
        """bwrap args that show the entry ``name`` of ``dir_fd`` at ``dest``: a link remade with the
        target it has now (recorded for the link checks: in the dir ``links``, or as ``(dest,
        target)`` in the list ``links``), a dir (or, with ``files``, any other file but a device)
        bound from an fd of that very inode; nothing when it is gone or of another kind."""
        try:
            fd = os.open(name, _O_ENTRY, dir_fd=dir_fd)
        except OSError:
            return []  # gone while we looked: the agent may still be running
        try:
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink("", dir_fd=fd)
                if isinstance(links, list):
                    links.append((dest, target))
                else:  # as the verifier's root will have it, for the link checks
                    links.mkdir(exist_ok=True)
                    os.symlink(target, links / name)
                return ["--symlink", target, dest]
            device = stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            if not (stat.S_ISDIR(st.st_mode) or (files and not device)):
                return []
            # Above the fds the prefix opens (3, 4); bwrap closes it once bound.
            fds.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10))
            return ["--bind-fd", str(fds[-1]), dest]
        except OSError:
            return []
        finally:
            os.close(fd)

    def _var_tree(self, root: int, args: list[str], fds: list[int], links: list) -> bool:
        """The agent's /var with a /var/tmp of the verifier's own, when /var is a dir: each of its
        entries bound on a small tmpfs of bwrap's (a mount point inside the agent's live /var could
        be swapped for a link to anywhere while bwrap makes it). False when /var is something else."""
        try:
            var = os.open("var", _O_LIST, dir_fd=root)
        except OSError:
            return False
        try:
            args += ["--perms", "0755", "--size", str(1 << 20), "--tmpfs", "/var"]
            for name in sorted(os.listdir(var)):
                if name != "tmp":
                    args += self._bind_entry(var, name, f"/var/{name}", fds, links, files=True)
        finally:
            os.close(var)
        args += self._scratch("/var/tmp")
        return True

    def _view_host(self, parts, links: Path | None = None) -> str:
        """The host path of a path of the agent's view (components): its copy-on-write dirs merged,
        the top-level links a verifier's root was built with (``links``, from ``_verifier_tree``;
        the agent may change its own after that), the rest in its state."""
        dest = "/" + parts[0] if parts else "/"
        if dest in self.overlays:
            return os.path.join(self.overlays[dest][1], *parts[1:])
        if links is not None and parts and os.path.lexists(links / parts[0]):
            return os.path.join(links, *parts)
        return os.path.join(self.state, *parts)

    def _link_roots(self, links: Path | None = None) -> tuple[list, link_scan.HostOf, frozenset[str]]:
        """What the agent wrote, for ``link_scan``: its state (without the base's dirs and the
        kernel's), its copy-on-write changes of the base and the verifier's top-level ``links``; how
        its view maps to host paths."""
        base = {d.lstrip("/").split("/")[0] for _, d in _dests(self._base_args)}
        roots = [(self.state, ())]
        roots += [(self._upper / d.lstrip("/"), (d.lstrip("/"),)) for d in self.overlays]
        if links is not None:
            roots.append((links, ()))
        return roots, functools.partial(self._view_host, links=links), frozenset(base | _VERIFIER_OWN)

    def _link_scan(self, links: Path | None = None) -> str | None:
        """A link the agent made that leads the verifier into its own files, as a reason."""
        return link_scan.find_link_into_verifier(*self._link_roots(links))

    def _command(
        self, env: dict[str, str], cwd: str, argv: list[str], die_with_parent: bool = True
    ) -> list[str]:
        """bwrap args shared by commands and verifiers: capabilities, seccomp, clean env, cwd."""
        out = ["--seccomp", "3", "--new-session", "--cap-drop", "ALL"]
        if die_with_parent:
            out.append("--die-with-parent")
        for cap in CAPS:
            out += ["--cap-add", cap]
        out.append("--clearenv")
        for k, v in env.items():
            out += ["--setenv", k, v]
        return out + ["--chdir", cwd, "--", *argv]

    # ---- commands --------------------------------------------------------------------------------
    def _backend_env(self) -> dict[str, str]:
        out = dict(self.rootfs.env)
        if self.rootfs.path_prefix:
            out["PATH"] = ":".join(self.rootfs.path_prefix) + ":" + BASE_PATH
        return out

    def _exec_argv(
        self, argv: list[str], env: dict[str, str], cwd: str, interactive: bool, internal: bool = False
    ) -> list[str]:
        if self.child_pid is None or not self._alive():
            raise SandboxError(f"sandbox {self.id} is not running")
        if self.user is not None and not internal:
            from tmax_jax.sandbox.recipe import as_user_line

            argv = ["/bin/sh", "-c", as_user_line(self.user, argv, "HOME" in self.image_env)]
        return (
            self._host_prefix(self.cg, f"/proc/{self.child_pid}/ns/pid")
            + self._enter(("user", "net", "ipc", "uts", "cgroup"))
            + ["bwrap", "--pidns", "4", *self._mount_tree()]
            # No --die-with-parent with --pidns: bwrap's process in the joined pid namespace is
            # forked by an intermediate that exits at once, and if it sets its parent-death signal
            # before that exit lands it is SIGKILLed (a rare exit 137 under load). The process is
            # still a descendant of the host-side bwrap (a subreaper), so a timeout's tree kill
            # reaches it.
            + self._command(env, cwd, argv, die_with_parent=False)
        )

    def run_verifier(self, tests_dir, argv, *, timeout, env=None, private=False) -> VerifierRun:
        if self.child_pid is None or not self._alive():
            raise SandboxError(f"sandbox {self.id} is not running")
        timeout = self.clamp_timeout(timeout)
        strict = self.cfg.verifier_mode == "strict"
        if strict and not stop_pid_namespace(self.child_pid, self._holder):
            why = "the agent's processes could not be stopped before the tests"
            return VerifierRun(ExecResult("", f"verifier not run: {why}\n", 1), {}, why)
        self._verifications += 1
        # Beside the state, not in it: reachable by the sandbox's root, in no agent mount namespace.
        # As host root, a tmpfs of the task's storage size: what the tests leave there neither
        # fills the host's disk nor outlives the verification (an unmount removes it at once).
        vdir = self.stage / f"verifier-{self._verifications}"
        tests, logs = vdir / "tests", vdir / "logs"
        vlinks = vdir / "links"  # the verifier root's top-level links, for the link checks
        cg = None
        fds: list[int] = []
        try:
            stage_tests(vdir, tests_dir, self.cfg.disk_mb, SUBID_BASE if self.is_root else None)
            plugin_env = write_verifier_python(tests)
            tests.chmod(0o700 if private else 0o755)
            (logs / "verifier").mkdir(parents=True)
            guard = logs / Path(verifier_guard.GUARD_DIR).relative_to("/logs")
            guard.mkdir()
            self._give_to_sandbox(vdir)
            if self.cg is not None:
                # Its own limits: a fork bomb the agent left running cannot starve the verifier.
                cg = cgroup.Cgroup(f"{self.id}-v{self._verifications}")
                cg.create(pids_max=self.cfg.pids_max, memory_mb=self.cfg.memory_mb, cpus=self.cfg.cpus)
            tree, fds, nested = self._verifier_tree(tests, logs, vlinks)
            # strict: a network namespace of its own (loopback up), unless the task has a link out.
            own_net = strict and not self.cfg.network
            host_argv = (
                self._host_prefix(cg)
                + self._enter(("user",) if own_net else ("user", "net"))
                + ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
                + (["--unshare-net"] if own_net else [])
                + tree
                + self._command(
                    self.verifier_environment(verifier_guard.merge_env(plugin_env, env)), "/tests", list(argv)
                )
            )
            host_of = functools.partial(self._view_host, links=vlinks)
            nested_link = next(
                (
                    f"{dest} is a link into the verifier's own files ({where})"
                    for dest, target in nested
                    if (where := link_scan.reaches_verifier(host_of, dest.split("/")[1:-1], target))
                ),
                None,
            )
            # Links into the verifier's files: the watch sees those made from here on, the scans
            # those made before and left after.
            links = link_scan.LinkWatch(*self._link_roots(vlinks)).start()
            try:
                shadow = nested_link or podman_toolchain.shadow_scan(self.state) or self._link_scan(vlinks)
                if shadow:
                    return VerifierRun(ExecResult("", f"verifier not run: {shadow}\n", 1), {}, shadow)
                if not self.overlays:
                    got = self._run_host(host_argv, timeout, fds)
                    # A shadowing module planted while the verifier ran (by a process the agent left).
                    tampered = (
                        links.stop() or podman_toolchain.shadow_scan(self.state) or self._link_scan(vlinks)
                    )
                    return self._verifier_run(got, logs, tampered)
                # The verifier sees the agent's copy-on-write base, as under Docker: its toolchain is
                # checked in the agent's upper dirs before, during and after (``podman_toolchain``).
                lowers = self._lowers()
                watch = podman_toolchain.Watch(self._upper).start()
                try:
                    before = podman_toolchain.scan(self._upper, lowers, tests)
                    if before:
                        result = ExecResult("", f"verifier not run: {before}\n", 1)
                    else:
                        result = self._run_host(host_argv, timeout, fds)
                finally:
                    during = watch.stop()
                tampered = (
                    before
                    or during
                    or links.stop()
                    or podman_toolchain.scan(self._upper, lowers, tests)
                    or podman_toolchain.shadow_scan(self.state)
                    or self._link_scan(vlinks)
                )
            finally:
                links.stop()
            if before:
                return VerifierRun(result, {}, tampered)
            return self._verifier_run(result, logs, tampered)
        finally:
            _close_fds(fds)
            if cg is not None:
                cg.kill_all()
                cg.remove()
            if not overlay.remove_unmounted_tree(vdir):
                self._left_behind = True  # the stage's removal at close tries again

    def _run_host(self, host_argv: list[str], timeout: float, fds: list[int]) -> ExecResult:
        """Run a verifier's host command, passing it the fds its mounts bind from."""
        got = run_capped(
            host_argv, timeout=timeout, cap=self.cfg.max_output_bytes, env={"PATH": BASE_PATH}, pass_fds=fds
        )
        self.exec_durations.append(got.duration_s)
        _close_fds(fds)
        return exec_result(got, self.cfg.max_output_bytes)

    @staticmethod
    def _verifier_run(result: ExecResult, logs: Path, tampered: str | None) -> VerifierRun:
        """What a verifier that ran left: its logs, and what its guard and reward files say."""
        guarded, suspect = verifier_guard.read_records(
            logs / Path(verifier_guard.GUARD_DIR).relative_to("/logs")
        )
        tampered = tampered or guarded or verifier_guard.reward_files_problem(logs / "verifier")
        return VerifierRun(result, read_verifier_logs(logs / "verifier"), tampered, suspect)

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
            if self.init.stdout and not self.init.stdout.closed:
                self.init.stdout.close()
        if self.child_pid is not None:
            # pid 1 of the namespace lingers in the kernel until every member is reaped.
            deadline = time.monotonic() + 10.0
            while pid_alive(self.child_pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        if self.cg is not None:
            self.cg.kill_all()
            self.cg.remove()
        if self.is_root and not remove_stage(self.stage):
            self._left_behind = True

    def memory_peak_bytes(self) -> int | None:
        return self.cg.memory_peak_bytes() if self.cg else None


def _is_root_user(user: str) -> bool:
    name, _, group = user.partition(":")
    return name in ("root", "0") and group in ("", "root", "0")


def _dests(args) -> list[tuple[str, str]]:
    """(source or target, destination) of each mount or symlink op in bwrap ``args``."""
    out, i = [], 0
    while i < len(args):
        if args[i] in ("--ro-bind", "--bind", "--symlink", "--ro-bind-try", "--bind-try"):
            out.append((args[i + 1], args[i + 2]))
            i += 3
        else:
            i += 1
    return out


def _symlinks(args) -> list[tuple[str, str]]:
    return [(args[i + 1], args[i + 2]) for i in range(len(args) - 2) if args[i] == "--symlink"]


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _without_symlinks(args) -> list[str]:
    out, i = [], 0
    while i < len(args):
        if args[i] == "--symlink":
            i += 3
            continue
        out.append(args[i])
        i += 1
    return out


def _make_stage_root() -> None:
    try:
        STAGE_ROOT.mkdir(mode=0o711, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(STAGE_ROOT)
    if not os.path.stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise SandboxError(f"{STAGE_ROOT} must be a directory owned by root and writable only by it")
    if st.st_mode & 0o777 != 0o711:
        os.chmod(STAGE_ROOT, 0o711)


def remove_stage(stage: Path) -> bool:
    """Unmount everything under a sandbox's stage dir (deepest first) and remove it; whether it is
    gone. The stage holds binds of host dirs (``_reachable``); if one stays mounted the stage is left
    in place (and said so) rather than deleted through it: a recursive delete there deletes the
    host's files."""
    return overlay.remove_unmounted_tree(stage)


def _reachable_by_others(path: str) -> bool:
    """Whether a process with no relation to the owners may look up ``path`` (every ancestor o+x)."""
    p = Path(path)
    for d in [*reversed(p.parents), p]:
        try:
            if not os.stat(d).st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


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
