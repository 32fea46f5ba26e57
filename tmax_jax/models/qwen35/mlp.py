"""SwiGLU feed-forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tmax_jax.models.qwen35.config import Qwen35Config
from tmax_jax.models.qwen35.params import make_param, normal


class SwiGLU(nnx.Module):
    def __init__(self, cfg: Qwen35Config, *, dtype, param_dtype, rngs: nnx.Rngs, stack: int | None = None):
        D, I = cfg.hidden_size, cfg.intermediate_size
        init = normal(cfg.initializer_range)
        self.dtype = dtype
        self.gate_proj = make_param(rngs, init, (D, I), ("embed", "mlp"), param_dtype, stack)
        self.up_proj = make_param(rngs, init, (D, I), ("embed", "mlp"), param_dtype, stack)
        self.down_proj = make_param(rngs, init, (I, D), ("mlp", "embed"), param_dtype, stack)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        dt = self.dtype
        gate_BxTxI = jnp.einsum("btd,di->bti", x_BxTxD, self.gate_proj[...].astype(dt))
        up_BxTxI = jnp.einsum("btd,di->bti", x_BxTxD, self.up_proj[...].astype(dt))
        return jnp.einsum("bti,id->btd", jax.nn.silu(gate_BxTxI) * up_BxTxI, self.down_proj[...].astype(dt))
