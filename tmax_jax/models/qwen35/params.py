"""Parameter creation with logical axis names, stacked along a leading ``layers`` axis when asked."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def normal(std: float) -> Init:
    return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)


def constant(value: float) -> Init:
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)


def log_uniform(low: float, high: float) -> Init:
    """log(U(low, high)): the Gated DeltaNet A_log init, so that -exp(A_log) stays away from 0."""
    return lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, low, high))


def make_param(
    rngs: nnx.Rngs,
    init: Init,
    shape: Sequence[int],
    names: Sequence[str | None],
    dtype: jnp.dtype,
    stack: int | None,
) -> nnx.Param:
    """An ``nnx.Param`` of ``shape`` (``[stack, *shape]`` when stacked) tagged with logical axis names."""
    if len(shape) != len(names):
        raise ValueError(f"shape {tuple(shape)} and axis names {tuple(names)} differ in rank")
    shape = tuple(shape)
    names = tuple(names)
    if stack is not None:
        shape = (stack, *shape)
        names = ("layers", *names)
    # Placement is explicit (load_hf(mesh=...) or the sharding rules table), never implied by a context mesh.
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)
