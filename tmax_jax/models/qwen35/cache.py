"""Decode cache for Qwen 3.5: KV for the full-attention layers, conv + recurrent state for Gated DeltaNet.

One array per layer for every kind of state, so that a decode step reads and writes each layer's
buffers in place: a slice of a layer-stacked array is a copy on XLA's CPU backend (at 4,096 cached
keys the K/V slices were a third of the step), and writing it back another. The batch (slot) axis is
axis 0 of every array. ``stacked()`` gives the layer-stacked form (copies) for loops over periods.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tmax_jax.models.qwen35.config import Qwen35Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen35Cache:
    lengths: jax.Array  # int32 [B]: valid tokens so far per row
    # Head-major, so that decode attention reads each head's keys and values as one matrix (a
    # [.., max_len, heads, ..] layout costs a transposed copy of every layer's cache per step). Keys
    # with positions minor, [head_dim, max_len]: the scores q K are a plain matrix product per head,
    # which XLA's CPU backend runs 1.8-4x faster than q against [max_len, head_dim] keys (a decode
    # step over 1,024-16,384 cached keys: 10-25% faster); values stay [max_len, head_dim] for p V.
    k: tuple[jax.Array, ...]  # per attention layer: [B, num_kv_heads, head_dim, max_len] (cache dtype)
    v: tuple[jax.Array, ...]  # per attention layer: [B, num_kv_heads, max_len, head_dim] (cache dtype)
    conv: tuple[jax.Array, ...]  # per DeltaNet layer: [B, K, conv_dim] (cache dtype), its last K inputs
    recurrent: tuple[jax.Array, ...]  # per DeltaNet layer: [B, Hv, dk, dv] float32
    # Per-row state a caller carries with the cache (batch axis 0 in every leaf); the model keeps it
    # as it is. The engine's speculative decoding holds the draft model's pending inputs here.
    draft: Any = None

    @classmethod
    def create(cls, cfg: Qwen35Config, batch_size: int, max_len: int, dtype=jnp.bfloat16) -> Qwen35Cache:
        La, Ll = cfg.num_full_layers, cfg.num_linear_layers
        k_shape, v_shape = cls.kv_shapes(cfg, batch_size, max_len)
        conv_shape = (batch_size, cfg.linear_conv_kernel_dim, cfg.conv_dim)
        rec_shape = (
            batch_size,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        )
        return cls(
            lengths=jnp.zeros((batch_size,), jnp.int32),
            k=tuple(jnp.zeros(k_shape, dtype) for _ in range(La)),
            v=tuple(jnp.zeros(v_shape, dtype) for _ in range(La)),
            conv=tuple(jnp.zeros(conv_shape, dtype) for _ in range(Ll)),
            recurrent=tuple(jnp.zeros(rec_shape, jnp.float32) for _ in range(Ll)),
        )

    @staticmethod
    def kv_shapes(
        cfg: Qwen35Config, batch_size: int, max_len: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(key shape, value shape) of one attention layer's cache."""
        G, E = cfg.num_key_value_heads, cfg.head_dim
        return (batch_size, G, E, max_len), (batch_size, G, max_len, E)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int | None:
        """KV positions per row (None without attention layers: nothing to narrow)."""
        return self.v[0].shape[2] if self.v else None

    def stacked(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(k, v, conv, recurrent), each stacked over its layers (leading axis; copies)."""

        def stack(arrays):
            return jnp.stack(arrays) if arrays else jnp.zeros((0, self.batch_size))

        return stack(self.k), stack(self.v), stack(self.conv), stack(self.recurrent)

    def replace(self, **changes) -> Qwen35Cache:
        return dataclasses.replace(self, **changes)

    def reset_rows(self, rows_B: jax.Array) -> Qwen35Cache:
        """Empties the rows where ``rows_B`` is True (a slot handed to a new sequence); jit-able."""
        keep = ~rows_B

        def clear(arrays):
            return tuple(x * keep.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype) for x in arrays)

        return self.replace(
            lengths=jnp.where(keep, self.lengths, 0),
            k=clear(self.k),
            v=clear(self.v),
            conv=clear(self.conv),
            recurrent=clear(self.recurrent),
        )

    def narrow(self, length: int) -> Qwen35Cache:
        """The same cache with the KV arrays cut to their first ``length`` positions (static), so that
        attention reads only that many keys. Rows must hold fewer than ``length`` tokens after the
        calls that use it; write the result back with :meth:`widen_into`."""
        if not self.k or length >= self.max_len:
            return self
        return self.replace(
            k=tuple(a[..., :length] for a in self.k), v=tuple(a[:, :, :length] for a in self.v)
        )

    def widen_into(self, full: Qwen35Cache) -> Qwen35Cache:
        """This (narrowed) cache written into ``full``'s KV arrays; the other leaves are this one's."""
        if self.max_len == full.max_len:
            return self

        def put(bigs, smalls, axis):
            return tuple(
                jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), 0, axis=axis)
                for big, small in zip(bigs, smalls)
            )

        return self.replace(k=put(full.k, self.k, 3), v=put(full.v, self.v, 2))
