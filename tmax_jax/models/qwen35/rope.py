"""Partial rotary embeddings (rotate-half) on the first ``rotary_dim`` dims of each head.

Qwen 3.5 uses interleaved mRoPE; for text every one of its three position streams equals the token
position, so it reduces to plain 1-D RoPE over the rotary dims. Qwen3 may extend its context with
YaRN (``rope_scaling`` of type "yarn").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def yarn_inv_freq(
    rotary_dim: int, theta: float, factor: float, original_max: int, beta_fast=32.0, beta_slow=1.0
):
    """YaRN (arXiv 2309.00071) inverse frequencies (NumPy float64 -> float32) and the cos/sin scale.

    Dimensions that turn fewer than ``beta_slow`` times over the original context are interpolated
    (frequency / factor), those turning more than ``beta_fast`` times kept, a linear ramp between
    (its ends rounded outwards); cos/sin are scaled by 0.1 ln(factor) + 1."""
    half = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    pos_freqs = theta**half

    def dim_of(rotations):  # the dimension that turns ``rotations`` times over the original context
        return rotary_dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), rotary_dim - 1)
    if high == low:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1.0 - keep) + (1.0 / pos_freqs) * keep
    scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq.astype(np.float32), scale


def rope_cos_sin(
    positions_BxT: jax.Array, rotary_dim: int, theta: float, yarn: tuple[float, int] | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables ``[B, T, rotary_dim]`` in float32. ``yarn``: (factor, original max positions)."""
    scale = 1.0
    if yarn is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    else:
        inv_freq, scale = yarn_inv_freq(rotary_dim, theta, *yarn)
        inv_freq = jnp.asarray(inv_freq)
    freqs_BxTxR2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq.reshape(
        (1,) * positions_BxT.ndim + (-1,)
    )
    freqs_BxTxR = jnp.concatenate([freqs_BxTxR2, freqs_BxTxR2], axis=-1)
    if scale == 1.0:
        return jnp.cos(freqs_BxTxR), jnp.sin(freqs_BxTxR)
    return jnp.cos(freqs_BxTxR) * scale, jnp.sin(freqs_BxTxR) * scale


def apply_partial_rope(x_BxTxHxD: jax.Array, cos_BxTxR: jax.Array, sin_BxTxR: jax.Array) -> jax.Array:
    rot = cos_BxTxR.shape[-1]
    # The reference rounds cos/sin to the compute dtype before rotating; do the same.
    cos = cos_BxTxR.astype(x_BxTxHxD.dtype)[:, :, None, :]
    sin = sin_BxTxR.astype(x_BxTxHxD.dtype)[:, :, None, :]
    x_rot, x_pass = x_BxTxHxD[..., :rot], x_BxTxHxD[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
