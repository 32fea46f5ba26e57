"""Local Podman images: a base imported from a host-built rootfs, task images built on top.

No registry is reachable, so base names in Dockerfiles (``ubuntu:24.04``, ``python:3.12-slim``, ...)
are rewritten to the local base image ``localhost/tmax-base:<rootfs id>``. Task images are tagged
by a content hash of the recipe and its files, so each is built once.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tmax_jax.errors import SandboxError
from tmax_jax.sandbox import rootfs as rootfs_mod
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.layers import _sources, tree_hash
from tmax_jax.sandbox.recipe import Recipe

BASE_REPO = "localhost/tmax-base"
TASK_REPO = "localhost/tmax-task"


@dataclass(frozen=True)
class PodmanImage:
    tag: str
    workdir: str | None = None


def podman_available() -> tuple[bool, str]:
    """(works, reason): podman present and able to run a container with runc here."""
    if shutil.which("podman") is None:
        return False, "podman is not installed"
    if shutil.which("runc") is None:
        return False, "runc is not installed (podman needs --runtime runc on hybrid cgroups)"
    r = subprocess.run(
        ["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if r.returncode != 0:
        return False, f"podman info failed: {r.stderr.strip()[-300:]}"
    return True, ""


def _podman(
    args: list[str], timeout: float = 600, input_bytes: bytes | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, timeout=timeout, input=input_bytes)


def image_exists(tag: str) -> bool:
    return _podman(["image", "exists", tag], timeout=60).returncode == 0


def ensure_base_image(cfg: SandboxConfig) -> str:
    """Build (once) the host-derived rootfs and import it as the local base image."""
    from tmax_jax.sandbox.rootfs_builder import cached_host_rootfs

    rootfs_dir, ident = cached_host_rootfs(cfg.cache_dir)
    tag = f"{BASE_REPO}:{ident}"
    if image_exists(tag):
        return tag
    tar = subprocess.Popen(["tar", "-C", str(rootfs_dir), "-c", "."], stdout=subprocess.PIPE)
    r = subprocess.run(
        [
            "podman",
            "import",
            "--change",
            "CMD /bin/bash",
            "--change",
            "ENV PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "-",
            tag,
        ],
        stdin=tar.stdout,
        capture_output=True,
        timeout=600,
    )
    tar.wait()
    if r.returncode != 0:
        raise SandboxError(
            f"podman import of the base rootfs failed: {r.stderr.decode(errors='replace')[-800:]}"
        )
    return tag


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
    for st in recipe.steps:
        if st.kind == "workdir":
            workdir = st.args[0] if st.args[0].startswith("/") else f"{workdir or ''}/{st.args[0]}"
    if dockerfile is None and not recipe.steps:
        return PodmanImage(map_base(cfg, recipe.base), workdir)
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
    h.update(base.encode())
    tag = f"{TASK_REPO}:{h.hexdigest()[:24]}"
    if image_exists(tag):
        return PodmanImage(tag, workdir)
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
        args = ["build", "--runtime", cfg.podman_runtime, "-f", str(ctx / "Containerfile.tmax"), "-t", tag]
        args += [f"--ulimit=nofile={cfg.nofile}:{cfg.nofile}", "--ulimit=nproc=4096:4096"]
        if not cfg.network:
            args.append("--network=none")
        r = _podman([*args, str(ctx)], timeout=timeout_s)
    if r.returncode != 0:
        raise SandboxError(f"podman build failed:\n{(r.stdout + r.stderr).decode(errors='replace')[-2000:]}")
    return PodmanImage(tag, workdir)


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
