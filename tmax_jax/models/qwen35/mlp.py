"""SwiGLU feed-forward; long sequences run in chunks with a hand-written backward pass."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tmax_jax.models.qwen35.config import Qwen35Config
from tmax_jax.models.qwen35.numerics import merge_tokens, scan_into, split_tokens, zeros_after
from tmax_jax.models.qwen35.params import make_param, normal

f32 = jnp.float32
# Past this many tokens the [B, T, intermediate] activations (3x the hidden width) are built one
# chunk at a time, forward and backward: memory O(chunk), not O(T).
MLP_CHUNK = 1024


def _swiglu(x_BxTxD, w_gate, w_up, w_down):
    gate_BxTxI = jnp.einsum("btd,di->bti", x_BxTxD, w_gate)
    up_BxTxI = jnp.einsum("btd,di->bti", x_BxTxD, w_up)
    return jnp.einsum("bti,id->btd", jax.nn.silu(gate_BxTxI) * up_BxTxI, w_down)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def chunked_swiglu(x_BxTxD, w_gate, w_up, w_down, chunk: int, dtype):
    """SwiGLU over sequence chunks; weights (any dtype) are cast to ``dtype`` once. The backward pass
    recomputes each chunk and sums the weights' gradients in float32 (autodiff through a chunk loop
    would carry and copy every weight and its cotangent through the loop)."""
    ws = tuple(w.astype(dtype) for w in (w_gate, w_up, w_down))
    _, y = scan_into(lambda c, xc: (c, _swiglu(xc, *ws)), (), split_tokens(x_BxTxD, chunk), after=x_BxTxD)
    return merge_tokens(y, x_BxTxD.shape[1])


def _chunked_fwd(x, w_gate, w_up, w_down, chunk, dtype):
    return chunked_swiglu(x, w_gate, w_up, w_down, chunk, dtype), (x, w_gate, w_up, w_down)


def _swiglu_grads(x, dy, wg, wu, wd, dtype):
    """SwiGLU's backward from its input ``x`` and output cotangent ``dy`` (both ``dtype``), the gate
    and up projections recomputed: (dx, (d w_gate, d w_up, d w_down)), all float32."""
    gate = jnp.einsum("btd,di->bti", x, wg)
    up = jnp.einsum("btd,di->bti", x, wu)
    g32 = gate.astype(f32)
    sig = jax.nn.sigmoid(g32)
    silu = (g32 * sig).astype(dtype)
    h = silu * up
    dh = jnp.einsum("btd,id->bti", dy, wd, preferred_element_type=f32)
    dgate = (dh * up.astype(f32) * sig * (1 + g32 * (1 - sig))).astype(dtype)
    dup = (dh * silu.astype(f32)).astype(dtype)
    dx = jnp.einsum("bti,di->btd", dgate, wg, preferred_element_type=f32) + jnp.einsum(
        "bti,di->btd", dup, wu, preferred_element_type=f32
    )
    dws = (
        jnp.einsum("btd,bti->di", x, dgate, preferred_element_type=f32),
        jnp.einsum("btd,bti->di", x, dup, preferred_element_type=f32),
        jnp.einsum("bti,btd->id", h, dy, preferred_element_type=f32),
    )
    return dx, dws


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def swiglu(x_BxTxD, w_gate, w_up, w_down, dtype):
    """SwiGLU in one piece, weights cast to ``dtype``. Its backward recomputes the gate and up
    projections instead of keeping three ``[B, T, intermediate]`` activations, and takes the weights'
    gradients as float32 matmuls (not rounded to ``dtype`` before the cast to the parameters')."""
    return _swiglu(x_BxTxD, *(w.astype(dtype) for w in (w_gate, w_up, w_down)))


def _swiglu_fwd(x, w_gate, w_up, w_down, dtype):
    return swiglu(x, w_gate, w_up, w_down, dtype), (x, w_gate, w_up, w_down)


def _swiglu_bwd(dtype, res, dy):
    x, w_gate, w_up, w_down = res
    ws = (w_gate, w_up, w_down)
    dx, dws = _swiglu_grads(x, dy.astype(dtype), *(w.astype(dtype) for w in ws), dtype)
    return (dx.astype(x.dtype), *(d.astype(w.dtype) for d, w in zip(dws, ws)))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _chunked_bwd(chunk, dtype, res, dy_BxTxD):
    x, w_gate, w_up, w_down = res
    wg, wu, wd = (w.astype(dtype) for w in (w_gate, w_up, w_down))

    def step(acc, xs):
        x_c, dy_c = xs
        dx, dws = _swiglu_grads(x_c, dy_c, wg, wu, wd, dtype)
        return tuple(a + d for a, d in zip(acc, dws)), dx.astype(x.dtype)

    # Accumulators tied to this call's cotangent: as constants, XLA would copy every layer's at the
    # start of the backward pass (numerics.zeros_after).
    zeros = tuple(zeros_after(w.shape, f32, dy_BxTxD) for w in (w_gate, w_up, w_down))
    dy = dy_BxTxD.astype(dtype)
    (dwg, dwu, dwd), dx = scan_into(step, zeros, (split_tokens(x, chunk), split_tokens(dy, chunk)), after=dy)
    return (
        merge_tokens(dx, x.shape[1]),
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
            return swiglu(x_BxTxD, *weights, jnp.dtype(self.dtype))
        return chunked_swiglu(x_BxTxD, *weights, self.chunk, jnp.dtype(self.dtype))
