"""A hand-made checkpoint whose recompute waits for its own backward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tmax_jax.models.qwen35.numerics import merge_tokens, scan_into, split_tokens, zeros_after

# Token-wise stages of a checkpointed layer (tokenwise_chunked) run in chunks of this many tokens.
TOKEN_CHUNK = 1024


def _floating(a) -> bool:
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


def _zero_of(tree) -> jax.Array:
    """A float32 zero that no pass can compute before every float leaf of ``tree`` exists
    (``numerics.zeros_after`` of each; integer leaves, e.g. float0 cotangents, are skipped)."""
    zero = jnp.zeros((), jnp.float32)
    for a in jax.tree.leaves(tree):
        if _floating(a):
            zero = zero + zeros_after((), jnp.float32, a)
    return zero


def _anchor(tree, zero):
    """Every float leaf of ``tree`` plus ``zero``: the same values, available only after ``zero``."""
    return jax.tree.map(lambda a: a + zero.astype(a.dtype) if _floating(a) else a, tree)


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
        # The inputs, and the weights too: their compute-dtype casts (and the CPU's float32 copies
        # of those for its dots) would otherwise depend on nothing but the parameters, and XLA would
        # make every layer's at the start of the backward pass and keep them all.
        params, x = _anchor((params, x), _zero_of(g))
        (params, x, consts), g_floats = jax.lax.optimization_barrier(
            ((params, x, consts), [g_leaves[i] for i in floats])
        )
        for i, a in zip(floats, g_floats):
            g_leaves[i] = a
        return jax.vjp(fn, params, x, consts)[1](jax.tree.unflatten(g_def, g_leaves))

    apply.defvjp(fwd, bwd)
    return apply(params, x, consts)


def tokenwise_chunked(fn, params, xs, chunk: int):
    """``fn(params, xs)`` for a ``fn`` that works on each token alone (axis 1 of every leaf of ``xs``
    and of its output), run over chunks of ``chunk`` tokens with its own backward pass: the backward
    recomputes one chunk at a time and sums the parameters' gradients in float32, so neither pass
    holds more than one chunk's internals. Up to ``chunk`` tokens it is ``fn`` itself.
    """
    T = jax.tree.leaves(xs)[0].shape[1]
    if T <= chunk:
        return fn(params, xs)

    def split(a):
        return split_tokens(a, chunk)

    def merge(a):
        return merge_tokens(a, T)

    @jax.custom_vjp
    def run(params, xs):
        after = jax.tree.leaves(xs)[0]
        _, ys = scan_into(lambda c, x: (c, fn(params, x)), (), jax.tree.map(split, xs), after=after)
        return jax.tree.map(merge, ys)

    def fwd(params, xs):
        return run(params, xs), (params, xs)

    def bwd(res, dys):
        params, xs = res
        params = _anchor(params, _zero_of(dys))  # casts of the weights made when this runs
        acc0 = jax.tree.map(lambda p: zeros_after(p.shape, jnp.float32, jax.tree.leaves(dys)[0]), params)

        def step(acc, x_dy):
            x, dy = x_dy
            dp, dx = jax.vjp(fn, params, x)[1](dy)
            return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, dp), dx

        acc, dxs = scan_into(
            step, acc0, (jax.tree.map(split, xs), jax.tree.map(split, dys)), after=jax.tree.leaves(dys)[0]
        )
        return jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params), jax.tree.map(merge, dxs)

    run.defvjp(fwd, bwd)
    return run(params, xs)
