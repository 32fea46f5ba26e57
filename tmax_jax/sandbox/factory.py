"""``make_sandbox``: pick the backend from the config and start a sandbox on an image."""

from __future__ import annotations

from tmax_jax.errors import SandboxError
from tmax_jax.sandbox.base import Sandbox
from tmax_jax.sandbox.config import SandboxConfig


def make_sandbox(cfg: SandboxConfig | None = None, image=None, start: bool = True) -> Sandbox:
    """Start a sandbox. ``image``: for bwrap a ``BwrapImage``, a rootfs spec or None (cfg.rootfs);
    for podman an image name or ``PodmanImage``; for apptainer a ``.sif`` path or ``ApptainerImage``.

    The result is a context manager; ``close()`` kills every process and removes every dir.
    """
    cfg = cfg or SandboxConfig()
    if cfg.backend == "bwrap":
        from tmax_jax.sandbox.bwrap import BwrapImage, BwrapSandbox

        if isinstance(image, str):
            image = BwrapImage(rootfs=image)
        sb: Sandbox = BwrapSandbox(cfg, image)
    elif cfg.backend == "podman":
        from tmax_jax.sandbox.podman import PodmanSandbox

        sb = PodmanSandbox(cfg, image)
    elif cfg.backend == "apptainer":
        from tmax_jax.sandbox.apptainer import ApptainerSandbox

        sb = ApptainerSandbox(cfg, image)
    else:  # SandboxConfig already validates; kept for configs built with object.__setattr__
        raise SandboxError(f"unknown sandbox backend {cfg.backend!r}")
    return sb.start() if start else sb
