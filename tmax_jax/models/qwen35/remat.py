"""A hand-made checkpoint whose recompute waits for its own backward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _floating(a) -> bool:
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


def recompute_in_backward(fn, params, x, consts):
    """``fn(params, x, consts)``, whose backward pass recomputes it from its arguments alone: a
    hand-made checkpoint that keeps nothing else. ``x`` and ``consts`` may be pytrees, and ``fn``
    may return one (integer outputs get float0 cotangents and are left alone).

    jax.checkpoint is not enough on every backend: XLA's CPU pipeline drops optimization barriers,
    then schedules recomputes early or merges them with the forward pass's identical ops, and a
    rematerialised period holds every layer's internals at once. Here the recompute reads its inputs
    through a data dependency on the outputs' cotangents, so it runs only when its backward does.
    """

    @jax.custom_vjp
    def apply(params, x, consts):
        return fn(params, x, consts)

    def fwd(params, x, consts):
        return fn(params, x, consts), (params, x, consts)

    def bwd(res, g):
        params, x, consts = res
        g_leaves, g_def = jax.tree.flatten(g)
        floats = [i for i, a in enumerate(g_leaves) if _floating(a)]
        # One element of each cotangent, times 0 (not folded for floats; non-finite values read as 0):
        # a zero no pass can compute before the cotangents exist.
        zero = jnp.zeros((), jnp.float32)
        for i in floats:
            v = jnp.ravel(g_leaves[i])[0].astype(jnp.float32)
            zero = zero + jnp.where(jnp.isfinite(v), v, 0.0) * 0.0

        def anchor(a):
            return a + zero.astype(a.dtype) if _floating(a) else a

        # The inputs, and the weights too: their compute-dtype casts (and the CPU's float32 copies
        # of those for its dots) would otherwise depend on nothing but the parameters, and XLA would
        # make every layer's at the start of the backward pass and keep them all.
        params, x = jax.tree.map(anchor, (params, x))
        (params, x, consts), g_floats = jax.lax.optimization_barrier(
            ((params, x, consts), [g_leaves[i] for i in floats])
        )
        for i, a in zip(floats, g_floats):
            g_leaves[i] = a
        return jax.vjp(fn, params, x, consts)[1](jax.tree.unflatten(g_def, g_leaves))

    apply.defvjp(fwd, bwd)
    return apply(params, x, consts)
