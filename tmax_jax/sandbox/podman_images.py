"""Local Podman images: a base imported from a host-built rootfs, task images built on top.

No registry is reachable, so base names in Dockerfiles (``ubuntu:24.04``, ``python:3.12-slim``, ...)
are rewritten to the local base image ``localhost/tmax-base:<rootfs id>`` (the rootfs's content
hash). Task images are tagged by a content hash of the recipe, its files and the base image's id,
so each is built once.

Images are shared by every process using the same podman storage, so each name is built under a
lock kept beside that storage. The base image is imported under a temporary name, probed (its
Python must import its standard library) and only then tagged; on first use in a process it is
probed again, and a damaged one is re-imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from tmax_jax.cache_publish import file_lock
from tmax_jax.errors import SandboxError
from tmax_jax.sandbox import rootfs as rootfs_mod
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.layers import _sources, tree_hash
from tmax_jax.sandbox.procs import tool_env
from tmax_jax.sandbox.recipe import Recipe
from tmax_jax.sandbox.rootfs_builder import STDLIB_PROBE, cached_host_rootfs, check_rootfs

BASE_REPO = "localhost/tmax-base"
TASK_REPO = "localhost/tmax-task"
ROOTFS_LABEL = "tmax-jax.rootfs-id"


@dataclass(frozen=True)
class PodmanImage:
    tag: str
    workdir: str | None = None
    # The image's final USER (podman runs the agent's commands as it); None: root.
    user: str | None = None


def podman_available() -> tuple[bool, str]:
    """(works, reason): podman present and able to run a container with runc here."""
    if shutil.which("podman") is None:
        return False, "podman is not installed"
    if shutil.which("runc") is None:
        return False, "runc is not installed (podman needs --runtime runc on hybrid cgroups)"
    r = subprocess.run(
        ["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"],
        capture_output=True,
        env=tool_env(),
        text=True,
        timeout=60,
    )
    if r.returncode != 0:
        return False, f"podman info failed: {r.stderr.strip()[-300:]}"
    return True, ""


def _podman(
    args: list[str], timeout: float = 600, input_bytes: bytes | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["podman", *args], capture_output=True, env=tool_env(), timeout=timeout, input=input_bytes
    )


def image_exists(tag: str) -> bool:
    return _podman(["image", "exists", tag], timeout=60).returncode == 0


def image_id(tag: str) -> str | None:
    """The image's id (its config digest) or None when no image has that name."""
    r = _podman(["image", "inspect", "--format", "{{.Id}}", tag], timeout=60)
    if r.returncode != 0:
        return None
    return r.stdout.decode().strip() or None


_lock_root: Path | None = None


def _lock_dir() -> Path:
    """Locks for image names live beside podman's own storage: every process that shares the image
    store (whatever its TMAX_JAX_CACHE) then shares the locks."""
    global _lock_root
    if _lock_root is None:
        r = subprocess.run(
            ["podman", "info", "--format", "{{.Store.GraphRoot}}"],
            capture_output=True,
            env=tool_env(),
            text=True,
            timeout=60,
        )
        graph = r.stdout.strip() if r.returncode == 0 else ""
        _lock_root = (
            Path(graph) / "tmax-jax-locks" if graph else Path.home() / ".cache" / "tmax-jax-podman-locks"
        )
    return _lock_root


@contextlib.contextmanager
def image_lock(tag: str):
    """Exclusive across processes for the image name ``tag``."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", tag)
    with file_lock(_lock_dir() / f"{name}.lock"):
        yield


# tag -> image id that passed base_image_problem in this process (the probe costs a container start).
_verified: dict[str, str] = {}


def base_image_problem(cfg: SandboxConfig, tag: str, ident: str) -> str | None:
    """None when the image ``tag`` was imported from rootfs ``ident`` and its Python starts with a
    complete standard library, else what is wrong."""
    r = _podman(["image", "inspect", "--format", "{{json .Labels}}", tag], timeout=60)
    if r.returncode != 0:
        return f"image {tag} is missing"
    labels = json.loads(r.stdout.decode() or "null") or {}
    if labels.get(ROOTFS_LABEL) != ident:
        return f"image {tag} has {ROOTFS_LABEL}={labels.get(ROOTFS_LABEL)!r}, not {ident}"
    r = _podman(
        [
            "run", "--rm", "--runtime", cfg.podman_runtime, "--network", "none",
            f"--ulimit=nofile={cfg.nofile}:{cfg.nofile}", "--ulimit=nproc=4096:4096",
            tag, "/usr/bin/python3", "-I", "-c", STDLIB_PROBE,
        ],
        timeout=300,
    )  # fmt: skip
    if r.returncode != 0:
        return f"python3 in image {tag} cannot import its standard library: {r.stderr.decode(errors='replace')[-500:]}"
    return None


def ensure_base_image(cfg: SandboxConfig, repo: str = BASE_REPO) -> str:
    """The local base image ``<repo>:<rootfs content id>``, imported from the host-derived rootfs.

    Checked once per process per image (label + a Python start-up probe); a missing or damaged image
    is (re)imported under the image name's lock: into a temporary name, probed, then tagged."""
    rootfs_dir, ident = cached_host_rootfs(cfg.cache_dir)
    tag = f"{repo}:{ident}"
    img = image_id(tag)
    if img is not None and _verified.get(tag) == img:
        return tag
    if img is not None and base_image_problem(cfg, tag, ident) is None:
        _verified[tag] = img
        return tag
    with image_lock(tag):
        img = image_id(tag)  # another process may have re-imported it while we waited
        if img is not None and base_image_problem(cfg, tag, ident) is None:
            _verified[tag] = img
            return tag
        _verified[tag] = _import_base(cfg, rootfs_dir, repo, tag, ident, stale=img)
    return tag


def _import_base(
    cfg: SandboxConfig, rootfs_dir: Path, repo: str, tag: str, ident: str, stale: str | None
) -> str:
    tmp_tag = f"{repo}:tmp-{uuid.uuid4().hex[:12]}"
    tar = subprocess.Popen(["tar", "-C", str(rootfs_dir), "-c", "."], stdout=subprocess.PIPE)
    try:
        r = subprocess.run(
            [
                "podman", "import",
                "--change", "CMD /bin/bash",
                "--change", "ENV PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                "--change", f"LABEL {ROOTFS_LABEL}={ident}",
                "-", tmp_tag,
            ],
            stdin=tar.stdout,
            capture_output=True, env=tool_env(),
            timeout=600,
        )  # fmt: skip
    finally:
        tar.stdout.close()
        tar_rc = tar.wait()
    try:
        if r.returncode != 0:
            raise SandboxError(
                f"podman import of the base rootfs failed: {r.stderr.decode(errors='replace')[-800:]}"
            )
        if tar_rc != 0:
            raise SandboxError(f"tar of the base rootfs {rootfs_dir} failed (exit {tar_rc})")
        _, why = check_rootfs(rootfs_dir)
        if why is not None:
            raise SandboxError(f"the base rootfs changed while it was imported: {why}")
        why = base_image_problem(cfg, tmp_tag, ident)
        if why is not None:
            raise SandboxError(f"the freshly imported base image is broken: {why}")
        r = _podman(["tag", tmp_tag, tag], timeout=60)
        if r.returncode != 0:
            raise SandboxError(f"podman tag {tag} failed: {r.stderr.decode(errors='replace')[-500:]}")
    finally:
        tmp_id = image_id(tmp_tag)
        if tmp_id is not None and image_id(tag) == tmp_id:
            _podman(["untag", tmp_tag, tmp_tag], timeout=60)  # the image stays, under ``tag``
        elif tmp_id is not None:
            _podman(["rmi", "-f", tmp_tag], timeout=120)  # nothing runs from a temporary name
    new = image_id(tag)
    if stale is not None and stale != new:
        # Best effort: containers still running from the damaged image keep it alive.
        _podman(["rmi", stale], timeout=120)
    return new


def prebuilt_image(cfg: SandboxConfig, name: str, timeout_s: float = 900.0) -> PodmanImage | None:
    """A task's prebuilt image (``[environment] docker_image``): the local image of that name, used
    without pulling; else, with ``cfg.network``, pulled; else None (build the Dockerfile instead).
    Its WORKDIR and USER come from the image's own config."""
    name = name.removeprefix("docker://")
    if not image_exists(name):
        if not cfg.network:
            return None
        r = _podman(["pull", "-q", name], timeout=timeout_s)
        if r.returncode != 0:
            raise SandboxError(
                f"podman pull {name} failed: {r.stderr.decode(errors='replace').strip()[-500:]}"
            )
    r = _podman(
        ["image", "inspect", "--format", "{{.Config.WorkingDir}}\n{{.Config.User}}", name], timeout=60
    )
    if r.returncode != 0:
        raise SandboxError(f"podman image inspect {name} failed: {r.stderr.decode(errors='replace')[-300:]}")
    workdir, _, user = r.stdout.decode(errors="replace").rstrip("\n").partition("\n")
    user = user.strip()
    return PodmanImage(name, workdir.strip() or None, user if user not in ("", "root", "0", "0:0") else None)


def map_base(cfg: SandboxConfig, name: str) -> str:
    name = name.removeprefix("docker://")
    if rootfs_mod.is_known_base(name) or name in ("host", "scratch"):
        return ensure_base_image(cfg)
    if image_exists(name):
        return name
    raise SandboxError(
        f"image {name!r} is not available locally and no registry is reachable; build or load it first"
    )


_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.I | re.M)


def build_image(
    cfg: SandboxConfig, recipe: Recipe, dockerfile: Path | None = None, timeout_s: float = 600.0
) -> PodmanImage:
    """``podman build`` the task's Dockerfile (FROM lines mapped to local images), or a Containerfile
    generated from the recipe (container.def + setup.sh). Cached by content hash."""
    workdir = None
    user = recipe.user if recipe.user not in ("root", "0", "root:root", "0:0") else None
    for st in recipe.steps:
        if st.kind == "workdir":
            workdir = st.args[0] if st.args[0].startswith("/") else f"{workdir or ''}/{st.args[0]}"
    if dockerfile is None and not recipe.steps:
        return PodmanImage(map_base(cfg, recipe.base), workdir, user)
    h = hashlib.sha256()
    h.update(json.dumps(recipe.key_data()).encode())
    if dockerfile is not None:
        h.update(tree_hash(dockerfile.parent).encode())
    else:
        for st in recipe.steps:
            if st.kind in ("copy", "copy_host"):
                for p in _sources(recipe, st):
                    h.update(tree_hash(p).encode())
    base = map_base(cfg, recipe.base)
    # The base's image id, not only its name: a re-imported (repaired) base gets new task images.
    h.update(f"{base}@{image_id(base)}".encode())
    tag = f"{TASK_REPO}:{h.hexdigest()[:24]}"
    if image_exists(tag):
        return PodmanImage(tag, workdir, user)
    with image_lock(tag):
        if image_exists(tag):  # built by another process while we waited
            return PodmanImage(tag, workdir, user)
        _build_task_image(cfg, recipe, dockerfile, base, tag, timeout_s)
    return PodmanImage(tag, workdir, user)


def _build_task_image(
    cfg: SandboxConfig, recipe: Recipe, dockerfile: Path | None, base: str, tag: str, timeout_s: float
) -> None:
    # ``podman build -t`` names the image only once every step has succeeded.
    with tempfile.TemporaryDirectory(prefix="tmax-build-") as tmp:
        ctx = Path(tmp) / "ctx"
        if dockerfile is not None:
            shutil.copytree(dockerfile.parent, ctx, symlinks=True)
            text = dockerfile.read_text()

            def sub(m):
                img = m.group(3)
                mapped = map_base(cfg, img) if not _is_stage(text, img) else img
                return f"{m.group(1)}{m.group(2)}{mapped}{m.group(4)}"

            text = _FROM.sub(sub, text)
        else:
            ctx.mkdir()
            text = _containerfile(recipe, base, ctx)
        (ctx / "Containerfile.tmax").write_text(text)
        args = ["build", "--runtime", cfg.podman_runtime, "--http-proxy=false"]
        args += ["-f", str(ctx / "Containerfile.tmax"), "-t", tag]
        args += [f"--ulimit=nofile={cfg.nofile}:{cfg.nofile}", "--ulimit=nproc=4096:4096"]
        if not cfg.network:
            args.append("--network=none")
        r = _podman([*args, str(ctx)], timeout=timeout_s)
    if r.returncode != 0:
        raise SandboxError(f"podman build failed:\n{(r.stdout + r.stderr).decode(errors='replace')[-2000:]}")


def _is_stage(text: str, name: str) -> bool:
    return re.search(rf"^\s*FROM\s+\S+\s+AS\s+{re.escape(name)}\s*$", text, re.I | re.M) is not None


def _containerfile(recipe: Recipe, base: str, ctx: Path) -> str:
    lines = [f"FROM {base}"]
    for i, st in enumerate(recipe.steps):
        if st.kind == "env":
            lines.append(f"ENV {st.args[0]}={json.dumps(st.args[1])}")
        elif st.kind == "workdir":
            lines.append(f"WORKDIR {st.args[0]}")
        elif st.kind == "run":
            lines.append("RUN " + json.dumps(["/bin/bash", "-c", st.args[0]]))
        elif st.kind in ("copy", "copy_host"):
            stage = ctx / f"s{i}"
            stage.mkdir()
            srcs = _sources(recipe, st)
            for s in srcs:
                if s.is_dir():
                    shutil.copytree(s, stage / s.name, symlinks=True)
                else:
                    shutil.copy2(s, stage / s.name)
            dest = st.args[-1]
            if len(srcs) > 1 or dest.endswith("/"):
                lines += [f"COPY s{i}/{s.name} {dest.rstrip('/')}/{s.name}" for s in srcs]
            else:
                lines.append(f"COPY s{i}/{srcs[0].name} {dest}")
    return "\n".join(lines) + "\n"
