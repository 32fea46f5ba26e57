"""Qwen 3.5 RMSNorms. Statistics always in float32, whatever the compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_normalize_f32(x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _over_last(w: jax.Array, x: jax.Array) -> jax.Array:
    """A [D] weight as [1, ..., 1, D] for x's rank (explicit, so strict rank promotion holds)."""
    return w.reshape((1,) * (x.ndim - 1) + (-1,))


def zero_centred_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``norm(x) * (1 + w)`` in float32, cast back to x's dtype (weights are stored around 0)."""
    y = rms_normalize_f32(x, eps) * (1.0 + _over_last(weight, x).astype(jnp.float32))
    return y.astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``w * norm(x) * silu(gate)`` per head (DeltaNet output norm; weight is NOT zero-centred).

    The normalised value is rounded to x's dtype before the weight, as transformers does, so bf16
    runs match the reference's rounding points.
    """
    normed = rms_normalize_f32(x, eps).astype(x.dtype)
    y = (_over_last(weight, x).astype(x.dtype) * normed).astype(jnp.float32) * jax.nn.silu(
        gate.astype(jnp.float32)
    )
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, zero_centred: bool) -> jax.Array:
    """The decoder's RMSNorm: Qwen 3.5's zero-centred one, or Qwen3's ``w * norm(x)`` (weights
    around 1; the normalised value rounded to x's dtype before the weight, as transformers does)."""
    if zero_centred:
        return zero_centred_rms_norm(x, weight, eps)
    w = _over_last(weight, x).astype(x.dtype)
    return w * rms_normalize_f32(x, eps).astype(x.dtype)


def norm_init_value(zero_centred: bool) -> float:
    """The identity weight of ``rms_norm``."""
    return 0.0 if zero_centred else 1.0
