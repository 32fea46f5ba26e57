"""The platform a program is traced for: the one that decides kernels and matmul precision.

The host's backend (``jax.default_backend()``) is the wrong question when a CPU host compiles for a
TPU topology (``tmax-jax plan --compile``): the program must be the TPU program, Mosaic kernels and
all. :func:`target_platform` answers, in order:

1. the platform named by an enclosing :func:`compiling_for` (ahead-of-time compiles of programs
   traced without a mesh in context, e.g. the engine's, whose inputs carry the shardings);
2. the platform of the devices of the mesh in context (``jax.set_mesh``: the train step);
3. the host's backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import jax

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("tmax_target_platform", default=None)


def mesh_platform(mesh=None) -> str | None:
    """The platform of ``mesh``'s devices (default: the mesh in context); None without one."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0].platform
    device = getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None)


def target_platform() -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: what the program being traced will run on."""
    named = _PLATFORM.get()
    if named is not None:
        return named
    platform = mesh_platform()
    if platform is None:
        platform = jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Trace the body's programs for ``platform`` whatever the host or the mesh in context."""
    token = _PLATFORM.set("gpu" if platform in ("cuda", "rocm") else platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def several_devices() -> bool:
    """Whether the mesh in context spans more than one device: a custom call XLA cannot partition
    (a Pallas kernel) must then run inside ``shard_map``, replicated where no axis splits it."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and math.prod(mesh.axis_sizes) > 1
