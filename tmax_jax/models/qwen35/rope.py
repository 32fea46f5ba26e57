"""Partial rotary embeddings (rotate-half) on the first ``rotary_dim`` dims of each head.

Qwen 3.5 uses interleaved mRoPE; for text every one of its three position streams equals the token
position, so it reduces to plain 1-D RoPE over the rotary dims.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions_BxT: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables ``[B, T, rotary_dim]`` in float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs_BxTxR2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    freqs_BxTxR = jnp.concatenate([freqs_BxTxR2, freqs_BxTxR2], axis=-1)
    return jnp.cos(freqs_BxTxR), jnp.sin(freqs_BxTxR)


def apply_partial_rope(x_BxTxHxD: jax.Array, cos_BxTxR: jax.Array, sin_BxTxR: jax.Array) -> jax.Array:
    rot = cos_BxTxR.shape[-1]
    # The reference rounds cos/sin to the compute dtype before rotating; do the same.
    cos = cos_BxTxR.astype(x_BxTxHxD.dtype)[:, :, None, :]
    sin = sin_BxTxR.astype(x_BxTxHxD.dtype)[:, :, None, :]
    x_rot, x_pass = x_BxTxHxD[..., :rot], x_BxTxHxD[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
