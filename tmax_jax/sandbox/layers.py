"""Content-addressed environment layers for the bwrap backend.

A layer is what a recipe's steps wrote into the writable paths, replayed once in a build sandbox and
kept under ``<cache_dir>/layers/<sha256>/`` (``fs/`` + ``meta.json`` with ENV and WORKDIR). The key
hashes the rootfs id, the writable paths, every step and the bytes of every copied file, so editing
a fixture rebuilds and nothing else does. Sandboxes copy the layer into their private state.

A layer is built by one process at a time (``cache_publish``: a lock per key, a temporary dir
renamed into place, a manifest whose digest is the layer's content id) and checked against its
manifest on each use: a damaged layer is rebuilt, never copied into a sandbox.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import shlex
import shutil
import subprocess
from pathlib import Path

from tmax_jax.cache_publish import check_tree, publish_tree
from tmax_jax.errors import SandboxError, TaskFormatError
from tmax_jax.sandbox import rootfs as rootfs_mod
from tmax_jax.sandbox.bwrap import BwrapImage, BwrapSandbox
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.recipe import Recipe, Step

LAYER_FORMAT = 2


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    path = Path(path)
    if path.is_file():
        h.update(b"F" + oct(path.stat().st_mode & 0o777).encode() + path.read_bytes())
        return h.hexdigest()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            p = Path(root) / name
            rel = p.relative_to(path).as_posix()
            h.update(rel.encode() + b"\0" + oct(p.stat().st_mode & 0o777).encode() + b"\0")
            h.update(p.read_bytes() if not p.is_symlink() else os.readlink(p).encode())
    return h.hexdigest()


def _sources(recipe: Recipe, step: Step) -> list[Path]:
    out = []
    ctx = recipe.context or Path(".")
    for s in step.args[:-1]:
        p = Path(s) if step.kind == "copy_host" else ctx / s.lstrip("/")
        matches = sorted(p.parent.glob(p.name)) if any(c in p.name for c in "*?[") else [p]
        if not matches or not all(m.exists() for m in matches):
            raise TaskFormatError(f"{step.source or step.kind}: source {s!r} not found in {ctx}")
        out.extend(matches)
    return out


def layer_key(cfg: SandboxConfig, recipe: Recipe, rootfs_ident: str) -> str:
    data = {
        "v": LAYER_FORMAT,
        "rootfs": rootfs_ident,
        "writable": list(cfg.writable_paths),
        "recipe": recipe.key_data(),
    }
    data["files"] = [
        [str(p.name), tree_hash(p)]
        for st in recipe.steps
        if st.kind in ("copy", "copy_host")
        for p in _sources(recipe, st)
    ]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def rootfs_for_base(cfg: SandboxConfig, base: str) -> str:
    """A Dockerfile FROM / def From: image name -> the bwrap rootfs spec to use."""
    if Path(base).is_dir():
        return base
    if base in ("host", "scratch") or rootfs_mod.is_known_base(base.removeprefix("docker://")):
        return cfg.rootfs
    raise SandboxError(
        f"base image {base!r} has no local rootfs for the bwrap backend (known bases: "
        f"{', '.join(rootfs_mod.KNOWN_BASES)}); build one with sandboxes/build_rootfs.py or use --backend podman"
    )


def build_layer(cfg: SandboxConfig, recipe: Recipe, timeout_s: float = 600.0, log=None) -> BwrapImage:
    """Replay ``recipe`` in a build sandbox (cached by content); returns the image to start from."""
    rootfs_spec = rootfs_for_base(cfg, recipe.base)
    rfs = rootfs_mod.resolve(rootfs_spec, cfg.writable_paths)
    key = layer_key(cfg, recipe, rfs.ident)
    final = Path(cfg.cache_dir) / "layers" / key
    publish_tree(final, lambda tmp: _replay(cfg, recipe, rootfs_spec, tmp, timeout_s, log))
    meta = json.loads((final / "meta.json").read_text())
    return BwrapImage(rootfs=rootfs_spec, layer=final, env=meta["env"], workdir=meta["workdir"])


def layer_problem(layer: str | Path) -> str | None:
    """None when the layer dir is complete against its manifest, else what is wrong (cheap)."""
    return check_tree(layer)[1]


def _replay(cfg: SandboxConfig, recipe: Recipe, rootfs_spec: str, out: Path, timeout_s: float, log) -> None:
    """Run ``recipe``'s steps in a build sandbox and save what they wrote into ``out`` (empty)."""
    build_cfg = dataclasses.replace(cfg, rootfs=rootfs_spec, episode_timeout_s=max(timeout_s, 1.0))
    env: dict[str, str] = {}
    workdir = "/"
    sb = BwrapSandbox(build_cfg, BwrapImage(rootfs=rootfs_spec))
    try:
        rfs = sb.rootfs
        sb.start()
        for st in recipe.steps:
            where = st.source or st.kind
            if st.kind == "reset":
                # An earlier build stage ended: the next starts from the bare base in a new build
                # sandbox, as Docker's does, with only the stash of what later stages copy from it.
                stash = out / "stage-stash"
                if sb.exec(f"test -e {shlex.quote(st.args[0])}", cwd="/").ok:
                    sb.download(st.args[0], stash)
                sb.close()
                sb = BwrapSandbox(build_cfg, BwrapImage(rootfs=rootfs_spec))
                sb.start()
                if stash.exists():
                    sb.upload(stash, st.args[0])
                    shutil.rmtree(stash)
            elif st.kind == "env":
                env[st.args[0]] = st.args[1]
                sb.image_env[st.args[0]] = st.args[1]
            elif st.kind == "workdir":
                workdir = posixpath.normpath(posixpath.join(workdir, st.args[0]))
                if not sb.writable(workdir):
                    raise TaskFormatError(
                        f"{where}: WORKDIR {workdir} is inside the bwrap backend's read-only base ({', '.join(rfs.read_only)})"
                    )
                _check(sb.exec(f"mkdir -p {shlex.quote(workdir)}", cwd="/"), where)
            elif st.kind in ("copy", "copy_host"):
                dest = st.args[-1]
                dest_abs = posixpath.normpath(posixpath.join(workdir, dest))
                if not sb.writable(dest_abs):
                    raise TaskFormatError(
                        f"{where}: COPY destination {dest_abs} is inside the bwrap backend's read-only base ({', '.join(rfs.read_only)})"
                    )
                srcs = _sources(recipe, st)
                into_dir = dest.endswith("/") or len(srcs) > 1
                for src in srcs:
                    if src.is_dir():
                        sb.upload(src, dest_abs, replace=False)
                    else:
                        sb.upload(
                            src, posixpath.join(dest_abs, src.name) if into_dir else dest_abs, replace=False
                        )
            elif st.kind == "run":
                res = sb.exec(st.args[0], cwd=workdir, timeout=timeout_s)
                if log is not None:
                    log(res.output)
                if not res.ok:
                    tail = res.output[-1500:]
                    hint = (
                        " (the bwrap rootfs is read-only: install packages into the rootfs, or use --backend podman)"
                        if "Read-only file system" in tail or "Permission denied" in tail
                        else ""
                    )
                    raise SandboxError(
                        f"{where}: RUN failed with exit {res.exit_code}{' (timeout)' if res.timed_out else ''}{hint}:\n{tail}"
                    )
            else:
                raise TaskFormatError(f"unknown build step kind {st.kind!r}")
        (out / "fs").mkdir()
        r = subprocess.run(["cp", "-a", f"{sb.state}/.", f"{out}/fs/"], capture_output=True, text=True)
        if r.returncode != 0:
            raise SandboxError(f"saving layer failed: {r.stderr[-500:]}")
        # What the build changed in the copy-on-write base dirs (whiteouts and opaque dirs kept): a
        # lower layer of each sandbox's overlay of that dir.
        for dest, upper in sb.overlay_uppers().items():
            target = out / "fs" / dest.lstrip("/")
            if not any(upper.iterdir()):
                if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
                    target.rmdir()  # the empty mount point the build sandbox's root had
                continue
            target.mkdir(parents=True, exist_ok=True)
            r = subprocess.run(["cp", "-a", f"{upper}/.", f"{target}/"], capture_output=True, text=True)
            if r.returncode != 0:
                raise SandboxError(f"saving layer's {dest} failed: {r.stderr[-500:]}")
    finally:
        sb.close()
    # /logs and /tests belong to the episode, never to the environment; .tmax holds the sandbox's
    # scratch (/tmp, /run, /dev/shm), which a layer never kept.
    for p in ("logs", "tests", "solution", ".tmax"):
        shutil.rmtree(out / "fs" / p, ignore_errors=True)
    (out / "meta.json").write_text(
        json.dumps({"env": env, "workdir": workdir, "base": recipe.base, "rootfs": rootfs_spec})
    )


def _check(res, where: str) -> None:
    if not res.ok:
        raise SandboxError(f"{where}: failed (exit {res.exit_code}): {res.output[-800:]}")
