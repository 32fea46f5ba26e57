"""Apptainer backend (UNTESTED on the development machines: Apptainer is not installable there).

A sandbox is an Apptainer *instance* started with ``--containall --net --network none`` and a
writable tmpfs overlay; commands run with ``apptainer exec instance://NAME``. Images are ``.sif``
files: the base is built from the host-derived rootfs directory, task images from a generated
``.def`` (Bootstrap: localimage) that replays the recipe's %files / %environment / %post.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tmax_jax.cache_publish import publish_file
from tmax_jax.errors import SandboxError
from tmax_jax.sandbox import rootfs as rootfs_mod
from tmax_jax.sandbox.base import Sandbox
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.layers import _sources, tree_hash
from tmax_jax.sandbox.procs import tool_env
from tmax_jax.sandbox.recipe import Recipe


@dataclass(frozen=True)
class ApptainerImage:
    sif: Path
    workdir: str | None = None


def apptainer_available(binary: str = "apptainer") -> tuple[bool, str]:
    if shutil.which(binary) is None:
        return False, f"{binary} is not installed (not installable on the development machines)"
    return True, ""


def ensure_base_sif(cfg: SandboxConfig) -> Path:
    from tmax_jax.sandbox.rootfs_builder import cached_host_rootfs

    rootfs_dir, ident = cached_host_rootfs(cfg.cache_dir)
    sif = Path(cfg.cache_dir) / "sif" / f"tmax-base-{ident}.sif"
    # Built once across processes, into a temporary file renamed into place (cache_publish).
    return publish_file(sif, lambda tmp: _build(cfg, [str(tmp), str(rootfs_dir)], 1800))


def _build(cfg: SandboxConfig, args: list[str], timeout: float) -> None:
    r = subprocess.run(
        [cfg.apptainer_bin, "build", "--force", *args],
        capture_output=True,
        env=tool_env(),
        text=True,
        timeout=timeout,
    )
    if r.returncode != 0:
        raise SandboxError(f"apptainer build failed: {(r.stdout + r.stderr)[-2000:]}")


def definition_text(recipe: Recipe, base_sif: Path) -> str:
    """The .def that replays ``recipe`` on top of ``base_sif``."""
    files, env, post = [], [], []
    for st in recipe.steps:
        if st.kind in ("copy", "copy_host"):
            for s in _sources(recipe, st):
                dest = st.args[-1]
                if dest.endswith("/") or len(st.args) > 2:
                    dest = dest.rstrip("/") + "/" + s.name
                files.append(f"    {s} {dest}")
        elif st.kind == "env":
            env.append(f"    export {st.args[0]}={json.dumps(st.args[1])}")
            post.append(f"export {st.args[0]}={json.dumps(st.args[1])}")
        elif st.kind == "workdir":
            post.append(f"mkdir -p {st.args[0]} && cd {st.args[0]}")
        elif st.kind == "run":
            post.append(st.args[0])
    out = [f"Bootstrap: localimage\nFrom: {base_sif}\n"]
    if files:
        out.append("%files\n" + "\n".join(files) + "\n")
    if env:
        out.append("%environment\n" + "\n".join(env) + "\n")
    if post:
        out.append("%post\n" + "\n".join(post) + "\n")
    return "\n".join(out)


def build_sif(cfg: SandboxConfig, recipe: Recipe, timeout_s: float = 600.0) -> ApptainerImage:
    base = recipe.base.removeprefix("docker://")
    if not (rootfs_mod.is_known_base(base) or base in ("host", "scratch")) and not base.endswith(".sif"):
        raise SandboxError(f"base image {recipe.base!r} has no local .sif; build one first")
    base_sif = Path(base) if base.endswith(".sif") else ensure_base_sif(cfg)
    workdir = next((st.args[0] for st in reversed(recipe.steps) if st.kind == "workdir"), None)
    if not recipe.steps:
        return ApptainerImage(base_sif, workdir)
    text = definition_text(recipe, base_sif)
    h = hashlib.sha256(text.encode())
    for st in recipe.steps:
        if st.kind in ("copy", "copy_host"):
            for p in _sources(recipe, st):
                h.update(tree_hash(p).encode())
    sif = Path(cfg.cache_dir) / "sif" / f"task-{h.hexdigest()[:24]}.sif"
    deff = sif.with_suffix(".def")

    def build(tmp: Path) -> None:
        deff.write_text(text)  # under the sif's lock: no other writer
        _build(cfg, [str(tmp), str(deff)], timeout_s)

    publish_file(sif, build)
    return ApptainerImage(sif, workdir)


class ApptainerSandbox(Sandbox):
    backend = "apptainer"

    def __init__(self, cfg: SandboxConfig, image: ApptainerImage | str | Path | None = None):
        if isinstance(image, (str, Path)):
            image = ApptainerImage(Path(image))
        super().__init__(cfg, env=None, workdir=image.workdir if image else None)
        self.image = image
        self.name = f"tmax_{self.id.replace('-', '_')}"

    def _owner_extra(self) -> dict:
        return {"apptainer_instance": self.name, "apptainer_bin": self.cfg.apptainer_bin}

    def start_argv(self, sif: Path) -> list[str]:
        cfg = self.cfg
        argv = [cfg.apptainer_bin, "instance", "start", "--containall", "--writable-tmpfs", "--no-home"]
        if not cfg.network:
            argv += ["--net", "--network", "none"]
        argv += [f"--pids-limit={cfg.pids_max}", f"--memory={cfg.memory_mb}M", f"--cpus={cfg.cpus}"]
        state = self.run_dir / "state"
        for w in cfg.writable_paths:
            argv += ["--bind", f"{state / w.lstrip('/')}:{w}"]
        return argv + [str(sif), self.name]

    def _start(self) -> None:
        ok, why = apptainer_available(self.cfg.apptainer_bin)
        if not ok:
            raise SandboxError(why)
        sif = self.image.sif if self.image else ensure_base_sif(self.cfg)
        for w in self.cfg.writable_paths:
            (self.run_dir / "state" / w.lstrip("/")).mkdir(parents=True, exist_ok=True)
        r = subprocess.run(self.start_argv(sif), capture_output=True, env=tool_env(), text=True, timeout=300)
        if r.returncode != 0:
            raise SandboxError(f"apptainer instance start failed: {r.stderr.strip()[-800:]}")

    def _exec_argv(
        self, argv: list[str], env: dict[str, str], cwd: str, interactive: bool, internal: bool = False
    ) -> list[str]:
        host = [self.cfg.apptainer_bin, "exec", "--cleanenv", "--pwd", cwd]
        for k, v in env.items():
            host += ["--env", f"{k}={v}"]
        return host + [f"instance://{self.name}", *argv]

    def host_env(self) -> dict[str, str]:
        return tool_env()

    def _alive(self) -> bool:
        r = subprocess.run(
            [self.cfg.apptainer_bin, "instance", "list", "--json", self.name],
            capture_output=True,
            env=tool_env(),
            text=True,
            timeout=60,
        )
        return r.returncode == 0 and self.name in r.stdout

    def _close(self) -> None:
        subprocess.run(
            [self.cfg.apptainer_bin, "instance", "stop", "-F", self.name],
            capture_output=True,
            env=tool_env(),
            timeout=120,
        )
