"""Numerics and XLA-facing helpers of the layer stack: the precision of the float32 matmuls that must
stay float32 (delta-rule state, LM head), loop buffers tied to their data (``zeros_after``), and
16-bit loop slices as integer bits (``as_bits``, ``scan_into``), and sequences cut into token chunks
(``split_tokens``, ``merge_tokens``)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from tmax_jax.errors import ConfigError
from tmax_jax.target import target_platform

# How the float32 matmuls that must stay float32 (LM head, delta-rule state) run on an accelerator,
# by name (environment variable TMAX_JAX_F32_DOT). "highest" is exact float32: on GPUs that is
# CUDA-core FMA, no tensor cores (an H100 profile of the 2B train step at 8K tokens, 2026-12-05: the
# head's float32 matmuls were 487 of 1,483 ms of GPU time). The others split each float32 operand
# into bfloat16 (or TF32) parts and sum their tensor-core products in float32: "bf16x6" is meant
# to keep float32's error level, "bf16x3" and "tf32x3" to come close to it for less work;
# ``benchmarks/device_check.py --part check`` measures each against float64 on the device (not yet
# run on one). On CPU the default f32 dot is exact whatever the setting.
F32_DOT_ENV = "TMAX_JAX_F32_DOT"
F32_DOT_ALGORITHMS = {
    "highest": jax.lax.Precision.HIGHEST,
    "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
}


def f32_dot_setting() -> str:
    """The name set in ``TMAX_JAX_F32_DOT`` (default "highest"); a ConfigError for any other name."""
    name = os.environ.get(F32_DOT_ENV, "highest").strip().lower() or "highest"
    if name not in F32_DOT_ALGORITHMS:
        raise ConfigError(f"{F32_DOT_ENV}={name!r}; expected one of {sorted(F32_DOT_ALGORITHMS)}")
    return name


def f32_matmul_precision(backend: str | None = None):
    """The ``precision`` of the float32 matmuls that must stay float32: ``TMAX_JAX_F32_DOT``'s
    algorithm on accelerators, whose default f32 dot may round inputs (TF32 / bf16 passes).

    On CPU the default f32 dot is already exact float32; asking for HIGHEST there adds nothing and
    was seen to deadlock XLA's CPU thread pool next to LAPACK triangular solves on 2-core machines.
    """
    name = f32_dot_setting()  # checked on every backend, so a typo fails on CPU too
    if (backend or target_platform()) == "cpu":
        return None
    return F32_DOT_ALGORITHMS[name]


# The matmul precision policy, by name (environment variable TMAX_JAX_PRECISION, read at trace time).
# "mixed" (default): the chunked delta rule's matmuls take their operands in the inputs' dtype
# (bfloat16 for a bfloat16 model) with float32 accumulation, and the float32 LM head runs as three
# bfloat16 passes (``HEAD_DOT_DEFAULT``). "float32": every delta-rule matmul and the head at the
# float32-matmul precision (TMAX_JAX_F32_DOT), the policy before it: the baseline of comparisons.
# The float32 matmuls that remain under "mixed", each with its reason:
#   * delta rule, ``_unit_lower_inverse``: the UT transform's (I + A)^-1, [C, C] per chunk; its
#     powers of A grow before they cancel (as flash-linear-attention's solve_tril, in float32);
#   * delta rule, ``_chunk_cumsum``: the cumulative log-gates, whose exponentials decay the state;
#     three exact bfloat16 passes (``exact_sum_matmul``), the same sums as float32;
#   * recurrent delta rule (decode): ``k^T S`` and ``q^T S`` on the float32 state, a matrix-vector
#     product bound by reading the state (as flash-linear-attention's fused recurrent kernel);
#   * the LM head (``rl.logprobs.head_logits``): three bfloat16 passes summed in float32 (the
#     policy's log-probabilities, which DPPO compares between engine and trainer);
#   * model ``_split_small_weights``: a one-hot selection of small float32 weights (exact, tiny).
PRECISION_ENV = "TMAX_JAX_PRECISION"
PRECISION_POLICIES = ("mixed", "float32")
HEAD_DOT_DEFAULT = "bf16x3"


def precision_policy() -> str:
    """The name set in ``TMAX_JAX_PRECISION`` (default "mixed"); a ConfigError for any other name."""
    name = os.environ.get(PRECISION_ENV, "mixed").strip().lower() or "mixed"
    if name not in PRECISION_POLICIES:
        raise ConfigError(f"{PRECISION_ENV}={name!r}; expected one of {list(PRECISION_POLICIES)}")
    return name


def mixed_precision() -> bool:
    return precision_policy() == "mixed"


def head_dot_setting() -> str:
    """The float32 head's algorithm name: ``TMAX_JAX_F32_DOT`` when set, else under the "mixed"
    policy ``HEAD_DOT_DEFAULT`` (three passes), under "float32" the float32-matmul default."""
    if os.environ.get(F32_DOT_ENV, "").strip() or not mixed_precision():
        return f32_dot_setting()
    return HEAD_DOT_DEFAULT


def split_bf16(x: jax.Array, parts: int) -> list[jax.Array]:
    """float32 ``x`` as ``parts`` bfloat16 terms, largest first, whose float32 sum approximates it
    (three terms hold float32's 24 significant bits)."""
    out, rest = [], x.astype(jnp.float32)
    for _ in range(parts):
        p = rest.astype(jnp.bfloat16)
        out.append(p)
        rest = rest - p.astype(jnp.float32)
    return out


def exact_sum_matmul(spec: str, x: jax.Array, ones: jax.Array) -> jax.Array:
    """``einsum(spec, x, ones)`` for float32 ``x`` and a 0/1 matrix ``ones`` (a prefix sum, a
    selection): three bfloat16 matmuls with float32 accumulation, each product exact, so the result
    is float32 sums of ``x`` in another order."""
    w = ones.astype(jnp.bfloat16)
    terms = [jnp.einsum(spec, p, w, preferred_element_type=jnp.float32) for p in split_bf16(x, 3)]
    return terms[0] + (terms[1] + terms[2])


def zeros_after(shape, dtype, after: jax.Array) -> jax.Array:
    """Zeros of ``shape``/``dtype`` that XLA can compute only once ``after`` exists.

    A loop's zero-initialised buffer (an accumulator, a stacked output) is otherwise a constant:
    XLA merges the identical constants of every layer into one and gives each loop its own copy, and
    its scheduler is free to make those copies at the start of the backward pass, so every layer's
    buffers are live at once. A zero tied to the layer's data (``finite(x) * 0``, which no pass folds
    for floats) is made just before its own loop. ``after``: any float array of the same computation.
    """
    x = jnp.ravel(after)[0].astype(jnp.float32)
    z = jnp.where(jnp.isfinite(x), x, 0.0) * 0.0
    return jnp.broadcast_to(z.astype(dtype), shape)


def as_bits(x: jax.Array) -> jax.Array:
    """16-bit floats as their uint16 bits (a free bitcast), for slicing and updating inside loops.

    XLA's CPU float normalisation runs bfloat16 dynamic slices and updates in float32: it hoists a
    float32 copy of the whole input out of the loop (kept for the backward pass) and converts a whole
    bfloat16 buffer at every step. Integer slices and updates are native everywhere.
    """
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def from_bits(x: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def scan_into(f, init, xs, *, after: jax.Array, reverse: bool = False):
    """``jax.lax.scan(f, init, xs, reverse=reverse)`` whose stacked inputs are read, and stacked outputs
    written, through :func:`as_bits` slices, into output buffers made by :func:`zeros_after`.

    ``lax.scan``'s own output buffers start as shared zero constants (see ``zeros_after``), and its
    16-bit inputs are sliced in float32 on CPU. ``xs``: a pytree of arrays with a common leading axis.
    """
    n = jax.tree.leaves(xs)[0].shape[0]
    x_dtypes = jax.tree.map(lambda x: x.dtype, xs)
    xs_bits = jax.tree.map(as_bits, xs)
    y_struct = jax.eval_shape(lambda c, x: f(c, x)[1], init, jax.tree.map(lambda x: x[0], xs))
    ys0 = jax.tree.map(lambda s: as_bits(zeros_after((n, *s.shape), s.dtype, after)), y_struct)

    def body(i, state):
        c, ys = state
        j = n - 1 - i if reverse else i
        x = jax.tree.map(
            lambda xb, dt: from_bits(jax.lax.dynamic_index_in_dim(xb, j, 0, keepdims=False), dt),
            xs_bits,
            x_dtypes,
        )
        c, y = f(c, x)
        ys = jax.tree.map(lambda yb, yy: jax.lax.dynamic_update_index_in_dim(yb, as_bits(yy), j, 0), ys, y)
        return c, ys

    c, ys = jax.lax.fori_loop(0, n, body, (init, ys0))
    return c, jax.tree.map(lambda yb, s: from_bits(yb, s.dtype), ys, y_struct)


def split_tokens(a: jax.Array, chunk: int) -> jax.Array:
    """``[B, T, ...]`` as ``[n, B, chunk, ...]`` chunks of tokens, the last one zero-padded."""
    n = -(-a.shape[1] // chunk)
    a = jnp.pad(a, [(0, 0), (0, n * chunk - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
    return jnp.moveaxis(a.reshape(a.shape[0], n, chunk, *a.shape[2:]), 1, 0)


def merge_tokens(a: jax.Array, T: int) -> jax.Array:
    """``split_tokens``' inverse: ``[n, B, chunk, ...]`` back to ``[B, T, ...]``."""
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])[:, :T]
