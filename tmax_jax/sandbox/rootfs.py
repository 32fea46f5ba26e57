"""Read-only root filesystems for the bwrap backend, expressed as bwrap mount arguments.

``host``: the host's /usr and /etc (and the running Python's prefix, so ``python3 -m pytest`` works
in verifiers), never /root, /home, /work or /var. A sandbox's root directory is its own (writable,
as under Docker); these are mounted over it, copy-on-write as host root (``overlay.py``), else
read-only. A directory: every top-level entry of that rootfs
(made by ``sandboxes/build_rootfs.py`` or debootstrap), except the writable paths.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tmax_jax.errors import SandboxError

SKIP_TOP = {"proc", "dev", "sys", "tmp", "run", "mnt", "media", "lost+found", "boot"}
# The empty directories every Debian/Ubuntu/python base image has outside /usr and /etc (root's,
# 0755; /root 0700), so `cmd > /var/log/x.log` or `mkdir /var/lib/app` works as under Docker. Every
# sandbox has them (bwrap makes them in its state; the podman / apptainer base rootfs holds them);
# the host's own /var is never shown. /var/run and /var/lock link into /run, as in those images.
SKELETON = (
    "/var/log", "/var/lib", "/var/cache", "/var/spool", "/var/mail", "/var/opt", "/var/local",
    "/var/backups", "/home", "/root", "/opt", "/srv", "/mnt", "/media",
)  # fmt: skip
SKELETON_LINKS = (("/run", "/var/run"), ("/run/lock", "/var/lock"))
# Image names in Dockerfiles / task.toml that map to the configured rootfs (no registry here).
KNOWN_BASES = ("ubuntu", "debian", "python", "buildpack-deps", "alpine", "tmax-base", "localhost/tmax-base")
# Registries that serve Docker Hub's official images under another prefix, and Terminal-Bench's own
# base images (``ghcr.io/laude-institute/t-bench/ubuntu-24-04``, ``.../python-3-13``): same names.
_MIRROR_PREFIXES = (
    "docker.io/library/",
    "docker.io/",
    "index.docker.io/library/",
    "registry-1.docker.io/library/",
    "public.ecr.aws/docker/library/",
    "mirror.gcr.io/library/",
    "ghcr.io/laude-institute/t-bench/",
    "library/",
)


@dataclass(frozen=True)
class Rootfs:
    """bwrap args that mount the rootfs, extra PATH entries, and an id for layer cache keys."""

    args: tuple[str, ...]
    path_prefix: tuple[str, ...]
    ident: str
    # Mounted after the writable binds, so they may sit inside one (the host Python under /root).
    late_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def read_only(self) -> tuple[str, ...]:
        """Where the base is mounted (read-only); every other path of a sandbox is writable."""
        args = self.args + self.late_args
        return tuple(args[i + 2] for i in range(len(args) - 2) if args[i] in ("--ro-bind", "--symlink"))

    def writable(self, path: str) -> bool:
        """Whether a sandbox can write ``path`` (absolute): outside the base and the kernel's dirs."""
        return not any(
            path == d or path.startswith(d.rstrip("/") + "/")
            for d in (*self.read_only, "/proc", "/dev", "/sys")
        )


def _python_prefix() -> Path | None:
    prefix = Path(sys.base_prefix).resolve()
    if str(prefix).startswith("/usr"):
        return None
    return prefix


def host_rootfs() -> Rootfs:
    args: list[str] = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for name in ("bin", "lib", "lib64", "sbin", "lib32", "libx32"):
        p = Path("/") / name
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), f"/{name}"]
        elif p.is_dir():
            args += ["--ro-bind", str(p), f"/{name}"]
    prefix = _python_prefix()
    path_prefix: tuple[str, ...] = ()
    late: tuple[str, ...] = ()
    if prefix is not None:
        late = ("--ro-bind", str(prefix), str(prefix))
        path_prefix = (str(prefix / "bin"),)
    ident = hashlib.sha256(f"host:{os.uname().release}:{sys.version}:{prefix}".encode()).hexdigest()[:16]
    # The host's Python carries many pytest plugins (seconds to import); task verifiers need none.
    env = (("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1"),)
    return Rootfs(tuple(args), path_prefix, ident, late, env)


def dir_rootfs(root: Path, writable: tuple[str, ...]) -> Rootfs:
    root = root.resolve()
    if not (root / "usr").is_dir():
        raise SandboxError(f"rootfs {root} has no usr/ directory (build one with sandboxes/build_rootfs.py)")
    for tool in ("usr/bin/setpriv", "usr/bin/env", "bin/bash"):
        if not os.path.lexists(root / tool) and not (root / "usr" / tool.split("/", 1)[-1]).exists():
            raise SandboxError(f"rootfs {root} lacks {tool}, which the bwrap backend needs")
    top_writable = {w.strip("/").split("/")[0] for w in writable if w.count("/") == 1}
    args: list[str] = []
    for entry in sorted(root.iterdir()):
        name = entry.name
        if name in SKIP_TOP or name in top_writable:
            continue
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry), f"/{name}"]
        elif entry.is_dir():
            args += ["--ro-bind", str(entry), f"/{name}"]
    stamp = (
        (root / ".tmax-rootfs-id").read_text().strip()
        if (root / ".tmax-rootfs-id").is_file()
        else str(root.stat().st_mtime_ns)
    )
    ident = hashlib.sha256(f"dir:{root}:{stamp}".encode()).hexdigest()[:16]
    return Rootfs(tuple(args), (), ident)


def resolve(spec: str, writable: tuple[str, ...]) -> Rootfs:
    """``host``, a rootfs directory, or a known base image name (mapped to the host rootfs)."""
    if spec == "host":
        return host_rootfs()
    p = Path(spec)
    if p.is_dir():
        return dir_rootfs(p, writable)
    if is_known_base(spec):
        return host_rootfs()
    raise SandboxError(f"bwrap rootfs {spec!r} is neither 'host', a directory, nor a known base image name")


def is_known_base(image: str) -> bool:
    """Whether ``image`` (with or without tag, digest or a mirror registry's prefix) is one of
    ``KNOWN_BASES``, e.g. ``public.ecr.aws/docker/library/python:3.12-slim`` or ``ubuntu``."""
    name = image.strip().removeprefix("docker://").split("@")[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:  # a tag, not a registry's port
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    name = name.lower()
    for prefix in _MIRROR_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return any(name == b or name.startswith(b + "-") for b in KNOWN_BASES)
