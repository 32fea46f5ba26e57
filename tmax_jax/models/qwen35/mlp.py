"""SwiGLU feed-forward; long sequences run in chunks with a hand-written backward pass."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tmax_jax.models.qwen35.config import Qwen35Config
from tmax_jax.models.qwen35.numerics import scan_into, zeros_after
from tmax_jax.models.qwen35.params import make_param, normal

f32 = jnp.float32
# Past this many tokens the [B, T, intermediate] activations (3x the hidden width) are built one
# chunk at a time, forward and backward: memory O(chunk), not O(T).
MLP_CHUNK = 1024


def _swiglu(x_BxTxD, w_gate, w_up, w_down):
    gate_BxTxI = jnp.einsum("btd,di->bti", x_BxTxD, w_gate)
    up_BxTxI = jnp.einsum("btd,di->bti", x_BxTxD, w_up)
    return jnp.einsum("bti,id->btd", jax.nn.silu(gate_BxTxI) * up_BxTxI, w_down)


def _chunks(x_BxTxD, chunk):
    B, T, D = x_BxTxD.shape
    x = jnp.pad(x_BxTxD, ((0, 0), (0, (-T) % chunk), (0, 0)))
    return jnp.moveaxis(x.reshape(B, -1, chunk, D), 1, 0)  # [N, B, C, D]


def _unchunk(y_NxBxCxD, T):
    N, B, C, D = y_NxBxCxD.shape
    return jnp.moveaxis(y_NxBxCxD, 0, 1).reshape(B, N * C, D)[:, :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def chunked_swiglu(x_BxTxD, w_gate, w_up, w_down, chunk: int, dtype):
    """SwiGLU over sequence chunks; weights (any dtype) are cast to ``dtype`` once. The backward pass
    recomputes each chunk and sums the weights' gradients in float32 (autodiff through a chunk loop
    would carry and copy every weight and its cotangent through the loop)."""
    ws = tuple(w.astype(dtype) for w in (w_gate, w_up, w_down))
    _, y = scan_into(lambda c, xc: (c, _swiglu(xc, *ws)), (), _chunks(x_BxTxD, chunk), after=x_BxTxD)
    return _unchunk(y, x_BxTxD.shape[1])


def _chunked_fwd(x, w_gate, w_up, w_down, chunk, dtype):
    return chunked_swiglu(x, w_gate, w_up, w_down, chunk, dtype), (x, w_gate, w_up, w_down)


def _chunked_bwd(chunk, dtype, res, dy_BxTxD):
    x, w_gate, w_up, w_down = res
    wg, wu, wd = (w.astype(dtype) for w in (w_gate, w_up, w_down))

    def step(acc, xs):
        x_c, dy_c = xs
        gate = jnp.einsum("btd,di->bti", x_c, wg)
        up = jnp.einsum("btd,di->bti", x_c, wu)
        g32 = gate.astype(f32)
        sig = jax.nn.sigmoid(g32)
        silu = (g32 * sig).astype(dtype)
        h = silu * up
        dh = jnp.einsum("btd,id->bti", dy_c, wd, preferred_element_type=f32)
        dgate = (dh * up.astype(f32) * sig * (1 + g32 * (1 - sig))).astype(dtype)
        dup = (dh * silu.astype(f32)).astype(dtype)
        dx = jnp.einsum("bti,di->btd", dgate, wg, preferred_element_type=f32) + jnp.einsum(
            "bti,di->btd", dup, wu, preferred_element_type=f32
        )
        acc = (
            acc[0] + jnp.einsum("btd,bti->di", x_c, dgate, preferred_element_type=f32),
            acc[1] + jnp.einsum("btd,bti->di", x_c, dup, preferred_element_type=f32),
            acc[2] + jnp.einsum("bti,btd->id", h, dy_c, preferred_element_type=f32),
        )
        return acc, dx.astype(x.dtype)

    # Accumulators tied to this call's cotangent: as constants, XLA would copy every layer's at the
    # start of the backward pass (numerics.zeros_after).
    zeros = tuple(zeros_after(w.shape, f32, dy_BxTxD) for w in (w_gate, w_up, w_down))
    dy = dy_BxTxD.astype(dtype)
    (dwg, dwu, dwd), dx = scan_into(step, zeros, (_chunks(x, chunk), _chunks(dy, chunk)), after=dy)
    return (
        _unchunk(dx, x.shape[1]),
        dwg.astype(w_gate.dtype),
        dwu.astype(w_up.dtype),
        dwd.astype(w_down.dtype),
    )


chunked_swiglu.defvjp(_chunked_fwd, _chunked_bwd)


class SwiGLU(nnx.Module):
    def __init__(
        self,
        cfg: Qwen35Config,
        *,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
        stack: int | None = None,
        intermediate_size: int | None = None,  # default cfg.intermediate_size (MoE shared expert: its own)
    ):
        D = cfg.hidden_size
        I = cfg.intermediate_size if intermediate_size is None else intermediate_size
        init = normal(cfg.initializer_range)
        self.dtype = dtype
        self.chunk = MLP_CHUNK
        self.gate_proj = make_param(rngs, init, (D, I), ("embed", "mlp"), param_dtype, stack)
        self.up_proj = make_param(rngs, init, (D, I), ("embed", "mlp"), param_dtype, stack)
        self.down_proj = make_param(rngs, init, (I, D), ("mlp", "embed"), param_dtype, stack)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        weights = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        if x_BxTxD.shape[1] <= self.chunk:
            return _swiglu(x_BxTxD, *(w.astype(self.dtype) for w in weights))
        return chunked_swiglu(x_BxTxD, *weights, self.chunk, jnp.dtype(self.dtype))
