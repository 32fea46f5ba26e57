"""SwiGLU feed-forward, run over sequence chunks when the sequence is long."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tmax_jax.models.qwen35.config import Qwen35Config
from tmax_jax.models.qwen35.params import make_param, normal

# Past this many tokens the [B, T, intermediate] activations (3x the hidden width) are built one
# chunk at a time, each chunk rematerialised in the backward pass: memory O(chunk), not O(T).
MLP_CHUNK = 1024


class SwiGLU(nnx.Module):
    def __init__(self, cfg: Qwen35Config, *, dtype, param_dtype, rngs: nnx.Rngs, stack: int | None = None):
        D, I = cfg.hidden_size, cfg.intermediate_size
        init = normal(cfg.initializer_range)
        self.dtype = dtype
        self.chunk = MLP_CHUNK
        self.gate_proj = make_param(rngs, init, (D, I), ("embed", "mlp"), param_dtype, stack)
        self.up_proj = make_param(rngs, init, (D, I), ("embed", "mlp"), param_dtype, stack)
        self.down_proj = make_param(rngs, init, (I, D), ("mlp", "embed"), param_dtype, stack)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        dt = self.dtype
        weights = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])

        def mlp(weights, x_BxCxD):
            # Cast inside: chunked, the weights' cotangents then add up in the parameter dtype.
            w_gate, w_up, w_down = (w.astype(dt) for w in weights)
            gate_BxCxI = jnp.einsum("btd,di->bti", x_BxCxD, w_gate)
            up_BxCxI = jnp.einsum("btd,di->bti", x_BxCxD, w_up)
            return jnp.einsum("bti,id->btd", jax.nn.silu(gate_BxCxI) * up_BxCxI, w_down)

        B, T, D = x_BxTxD.shape
        C = self.chunk
        if T <= C:
            return mlp(weights, x_BxTxD)
        pad = (-T) % C
        x = jnp.pad(x_BxTxD, ((0, 0), (0, pad), (0, 0)))
        x_NxBxCxD = jnp.moveaxis(x.reshape(B, -1, C, D), 1, 0)
        step = jax.checkpoint(mlp, prevent_cse=False)
        _, y_NxBxCxD = jax.lax.scan(lambda w, xc: (w, step(w, xc)), weights, x_NxBxCxD)
        return jnp.moveaxis(y_NxBxCxD, 0, 1).reshape(B, T + pad, D)[:, :T]
