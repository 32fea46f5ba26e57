"""Build (or fetch from cache) the image a task's sandboxes start from, for each backend."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping

from tmax_jax.errors import TaskFormatError, TmaxError
from tmax_jax.sandbox.base import BASE_PATH
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.recipe import Recipe, Step, parse_apptainer_def, parse_dockerfile
from tmax_jax.tasks.model import Task

SETUP_DIR = "/tmp/tmax-setup"
# python:3.13-slim, docker.io/library/python:3.12, ghcr.io/laude-institute/t-bench/python-3-13:tag
_PYTHON_TAG = re.compile(r"(?:^|/)python(?::|-)(\d+)(?:[.-](\d+))?(?=$|[-.:@])")


def task_recipe(
    task: Task, base_env: Mapping[str, str] | None = None, read_only: tuple[str, ...] | None = None
) -> Recipe:
    """The task's environment as build steps (Dockerfile subset / container.def + setup.sh).

    base_env: what ``$PATH``/``$HOME`` of the base image are on the chosen backend; read_only: where
    its read-only base is mounted (an earlier build stage's output is cleared from everywhere else).
    """
    env = task.environment
    if env.kind == "dockerfile":
        recipe = parse_dockerfile(env.path, base_env=base_env, read_only=read_only)
    elif env.kind == "apptainer_def":
        recipe = parse_apptainer_def(env.path)
    elif env.kind == "image":
        recipe = Recipe(base=env.image, context=task.path)
    elif env.kind == "base":
        recipe = Recipe(base="host", context=task.path)
    else:
        raise TaskFormatError(f"{task.path}: unknown environment kind {env.kind!r}")
    if env.setup_script is not None:
        steps = []
        if env.fixtures_dir is not None:
            steps.append(Step("copy_host", (str(env.fixtures_dir), f"{SETUP_DIR}/fixtures"), 0, "fixtures/"))
        steps.append(Step("copy_host", (str(env.setup_script), f"{SETUP_DIR}/setup.sh"), 0, "setup.sh"))
        steps.append(Step("env", ("FIXTURES_DIR", f"{SETUP_DIR}/fixtures"), 0, "setup.sh"))
        steps.append(Step("run", (f"cd {SETUP_DIR} && bash ./setup.sh",), 0, "setup.sh"))
        recipe = dataclasses.replace(recipe, steps=[*recipe.steps, *steps])
    return recipe


def python_tag_version(image: str | None) -> tuple[int, ...] | None:
    """The Python version a base image's name promises (``python:3.13-slim`` -> (3, 13)), or None."""
    m = _PYTHON_TAG.search((image or "").split("@")[0])
    if not m:
        return None
    return (int(m.group(1)),) + ((int(m.group(2)),) if m.group(2) else ())


def python_mismatch(recipe: Recipe) -> str | None:
    """A note when the base image names a Python other than the one the sandbox provides (its
    rootfs is the host's, whatever the tag says); a TaskFormatError when the build depends on that
    version's ABI (a wheel tagged for it, its site-packages path): it could not build here."""
    want = python_tag_version(recipe.base)
    have = sys.version_info[: len(want)] if want else None
    if not want or tuple(have) == want:
        return None
    shown = ".".join(map(str, want))
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if len(want) == 2:
        tag = rf"cp{want[0]}{want[1]}\b|python{want[0]}\.{want[1]}\b"
        for st in recipe.steps:
            text = " ".join(st.args)
            if st.kind in ("run", "copy") and (m := re.search(tag, text)):
                raise TaskFormatError(
                    f"{st.source or st.kind} (line {st.line}): needs Python {shown}'s ABI ({m.group(0)}), "
                    f"but the base image {recipe.base} maps to the sandbox's Python {here}"
                )
    return f"base image {recipe.base} asks for Python {shown}; the sandbox provides Python {here}"


def environment_notes(task: Task) -> list[str]:
    """What a result should say about how the task's environment differs from what it asked for."""
    try:
        note = python_mismatch(task_recipe(task))
    except TmaxError:
        return []  # the build reports it
    return [note] if note else []


def _bwrap_base(cfg: SandboxConfig) -> tuple[dict[str, str], tuple[str, ...] | None]:
    """``$PATH`` as a bwrap sandbox has it (the rootfs's own entries, the host Python, first) and
    where its read-only base is mounted."""
    from tmax_jax.sandbox import rootfs

    try:
        rfs = rootfs.resolve(cfg.rootfs, cfg.writable_paths)
    except Exception:  # noqa: BLE001 - a bad rootfs is reported by the build itself
        return {"PATH": BASE_PATH, "HOME": "/root"}, None
    return {"PATH": ":".join([*rfs.path_prefix, BASE_PATH]), "HOME": "/root"}, rfs.read_only


def prepare_image(task: Task, cfg: SandboxConfig, log=None):
    """The backend's image for ``task``: BwrapImage (cached layer), podman tag, or .sif path."""
    base_env, read_only = _bwrap_base(cfg) if cfg.backend == "bwrap" else (None, None)
    recipe = task_recipe(task, base_env, read_only)
    python_mismatch(recipe)  # raises when the build needs the other Python's ABI
    timeout = task.limits.build_timeout_s
    if cfg.backend == "bwrap":
        from tmax_jax.sandbox.bwrap import BwrapImage
        from tmax_jax.sandbox.layers import build_layer, rootfs_for_base

        # The final USER: the agent's commands run as it, as under Docker (the verifier as root).
        user = recipe.user if recipe.user not in ("root", "0", "root:root", "0:0") else None
        if not recipe.steps:
            return BwrapImage(rootfs=rootfs_for_base(cfg, recipe.base), user=user)
        return dataclasses.replace(build_layer(cfg, recipe, timeout_s=timeout, log=log), user=user)
    if cfg.backend == "podman":
        from tmax_jax.sandbox.podman_images import build_image, prebuilt_image

        if task.environment.image and task.environment.kind == "dockerfile":
            # task.toml's docker_image (Terminal-Bench ships one per task): local, or pulled when
            # the run has the network; else the Dockerfile is built.
            img = prebuilt_image(cfg, task.environment.image)
            if img is not None:
                return img

        dockerfile = task.environment.path if task.environment.kind == "dockerfile" else None
        return build_image(cfg, recipe, dockerfile=dockerfile, timeout_s=timeout)
    if cfg.backend == "apptainer":
        from tmax_jax.sandbox.apptainer import build_sif

        return build_sif(cfg, recipe, timeout_s=timeout)
    raise TaskFormatError(f"unknown backend {cfg.backend!r}")


def sandbox_config_for(task: Task, cfg: SandboxConfig) -> SandboxConfig:
    """Apply the task's resource limits on top of the pool's config."""
    lim = task.limits
    return dataclasses.replace(
        cfg,
        cpus=lim.cpus,
        memory_mb=lim.memory_mb,
        disk_mb=lim.storage_mb,
        network=lim.allow_internet and cfg.network,
        # A task whose tests check the agent's services is verified as under Harbor.
        verifier_mode="harbor" if lim.agent_services else cfg.verifier_mode,
        episode_timeout_s=lim.agent_timeout_s + lim.verifier_timeout_s + 120.0,
    )
