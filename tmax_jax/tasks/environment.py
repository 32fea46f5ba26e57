"""Build (or fetch from cache) the image a task's sandboxes start from, for each backend."""

from __future__ import annotations

import dataclasses

from tmax_jax.errors import TaskFormatError
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.recipe import Recipe, Step, parse_apptainer_def, parse_dockerfile
from tmax_jax.tasks.model import Task

SETUP_DIR = "/tmp/tmax-setup"


def task_recipe(task: Task) -> Recipe:
    """The task's environment as build steps (Dockerfile subset / container.def + setup.sh)."""
    env = task.environment
    if env.kind == "dockerfile":
        recipe = parse_dockerfile(env.path)
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


def prepare_image(task: Task, cfg: SandboxConfig, log=None):
    """The backend's image for ``task``: BwrapImage (cached layer), podman tag, or .sif path."""
    recipe = task_recipe(task)
    timeout = task.limits.build_timeout_s
    if cfg.backend == "bwrap":
        from tmax_jax.sandbox.bwrap import BwrapImage
        from tmax_jax.sandbox.layers import build_layer, rootfs_for_base

        if not recipe.steps:
            return BwrapImage(rootfs=rootfs_for_base(cfg, recipe.base))
        return build_layer(cfg, recipe, timeout_s=timeout, log=log)
    if cfg.backend == "podman":
        from tmax_jax.sandbox.podman_images import build_image

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
        episode_timeout_s=lim.agent_timeout_s + lim.verifier_timeout_s + 120.0,
    )
