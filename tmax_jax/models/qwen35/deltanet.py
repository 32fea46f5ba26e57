"""Qwen 3.5 Gated DeltaNet layer: fused projections, causal depthwise conv + SiLU, the gated delta rule,
gated RMSNorm, output projection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tmax_jax.kernels import chunked_gated_delta_rule
from tmax_jax.models.qwen35.config import Qwen35Config
from tmax_jax.models.qwen35.delta_rule import recurrent_gated_delta_rule
from tmax_jax.models.qwen35.norms import gated_rms_norm
from tmax_jax.models.qwen35.params import constant, log_uniform, make_param, normal

f32 = jnp.float32


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _shift(x: jax.Array, lag: int, fill=0) -> jax.Array:
    """``x[:, t - lag]`` along axis 1 (``lag < 0``: from the future), ``fill`` where that is outside."""
    T = x.shape[1]
    pad = [(0, 0)] * x.ndim
    pad[1] = (lag, 0) if lag >= 0 else (0, -lag)
    padded = jnp.pad(x, pad, constant_values=fill)
    return padded[:, :T] if lag >= 0 else padded[:, -lag:]


def _same_group(groups_BxT: jax.Array, lag: int, dtype) -> jax.Array:
    """``[B, T, 1]``: 1 where token ``t - lag`` exists and is in token t's packed group."""
    return (_shift(groups_BxT, lag, -1) == groups_BxT)[..., None].astype(dtype)


# The weight gradient is reduced over time in blocks of this many tokens.
_CONV_GRAD_BLOCK = 512


@jax.custom_vjp
def causal_depthwise_conv(x_BxTxC: jax.Array, w_KxC: jax.Array, groups_BxT: jax.Array) -> jax.Array:
    """``out[t] = sum_j w[j] * x[t - (K-1) + j]``, using only taps from the same packed group.

    Its own backward pass: autodiff of the taps keeps one ``[B, T, C]`` product per tap for the weight
    gradient's reduction over time (in float32 on CPU), K of them at once; here that reduction runs
    over blocks of time, and the input gradient is the transposed taps.
    """
    K, T = w_KxC.shape[0], x_BxTxC.shape[1]
    out = x_BxTxC * w_KxC[None, None, K - 1]
    for lag in range(1, min(K, T)):
        out = (
            out
            + _shift(x_BxTxC, lag)
            * _same_group(groups_BxT, lag, x_BxTxC.dtype)
            * w_KxC[None, None, K - 1 - lag]
        )
    return out


def _conv_fwd(x_BxTxC, w_KxC, groups_BxT):
    return causal_depthwise_conv(x_BxTxC, w_KxC, groups_BxT), (x_BxTxC, w_KxC, groups_BxT)


def _conv_bwd(res, d_BxTxC):
    x, w, groups = res
    K, T = w.shape[0], x.shape[1]
    dx = d_BxTxC * w[None, None, K - 1]
    for lag in range(1, min(K, T)):
        dx = dx + _shift(d_BxTxC * _same_group(groups, lag, x.dtype), -lag) * w[None, None, K - 1 - lag]
    # dw[j] = sum_t d[t] x[t - (K-1) + j] (same group), block by block over time.
    Tb = min(_CONV_GRAD_BLOCK, T)
    pad = (-T) % Tb
    x_p = jnp.pad(x, ((0, 0), (K - 1, pad), (0, 0)))
    g_p = jnp.pad(groups, ((0, 0), (K - 1, pad)), constant_values=-1)
    d_p = jnp.pad(d_BxTxC, ((0, 0), (0, pad), (0, 0)))
    gd_p = jnp.pad(groups, ((0, 0), (0, pad)), constant_values=-2)

    def block(acc_KxC, t0):
        d_b = jax.lax.dynamic_slice_in_dim(d_p, t0, Tb, axis=1)
        g_b = jax.lax.dynamic_slice_in_dim(gd_p, t0, Tb, axis=1)
        x_w = jax.lax.dynamic_slice_in_dim(x_p, t0, Tb + K - 1, axis=1)
        g_w = jax.lax.dynamic_slice_in_dim(g_p, t0, Tb + K - 1, axis=1)
        taps = []
        for j in range(K):
            prod = x_w[:, j : j + Tb] * d_b
            if j < K - 1:
                prod = jnp.where((g_w[:, j : j + Tb] == g_b)[..., None], prod, jnp.zeros((), prod.dtype))
            taps.append(jnp.sum(prod.astype(f32), axis=(0, 1)))
        return acc_KxC + jnp.stack(taps), None

    dw, _ = jax.lax.scan(block, jnp.zeros(w.shape, f32), jnp.arange(0, T + pad, Tb))
    return dx, dw.astype(w.dtype), None


causal_depthwise_conv.defvjp(_conv_fwd, _conv_bwd)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: Qwen35Config, *, dtype, param_dtype, rngs: nnx.Rngs, stack: int | None = None):
        D, Hv = cfg.hidden_size, cfg.linear_num_value_heads
        init = normal(cfg.initializer_range)
        self.dtype = dtype
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = Hv
        self.dk = cfg.linear_key_head_dim
        self.dv = cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.chunk_size = cfg.chunk_size
        self.kernels = cfg.kernels
        self.in_proj_qkv = make_param(rngs, init, (D, cfg.conv_dim), ("embed", "lin_dim"), param_dtype, stack)
        self.in_proj_z = make_param(
            rngs, init, (D, cfg.lin_value_dim), ("embed", "lin_dim"), param_dtype, stack
        )
        self.in_proj_b = make_param(rngs, init, (D, Hv), ("embed", "lin_v_heads"), param_dtype, stack)
        self.in_proj_a = make_param(rngs, init, (D, Hv), ("embed", "lin_v_heads"), param_dtype, stack)
        self.conv_weight = make_param(
            rngs, normal(0.5), (self.kernel, cfg.conv_dim), ("conv_kernel", "lin_dim"), param_dtype, stack
        )
        self.dt_bias = make_param(rngs, constant(1.0), (Hv,), ("lin_v_heads",), param_dtype, stack)
        self.A_log = make_param(rngs, log_uniform(0.01, 16.0), (Hv,), ("lin_v_heads",), param_dtype, stack)
        self.norm = make_param(rngs, constant(1.0), (self.dv,), ("norm",), param_dtype, stack)
        self.out_proj = make_param(
            rngs, init, (cfg.lin_value_dim, D), ("lin_dim", "embed"), param_dtype, stack
        )

    def __call__(
        self,
        x_BxTxD: jax.Array,
        segment_ids_BxT: jax.Array,
        groups_BxT: jax.Array | None,
        *,
        state: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """``state`` = (conv ``[B, K, conv_dim]``, recurrent ``[B, Hv, dk, dv]`` float32) or None."""
        dt = self.dtype
        B, T, _ = x_BxTxD.shape
        Hk, Hv, dk, dv, K = self.num_k_heads, self.num_v_heads, self.dk, self.dv, self.kernel
        valid_BxT = segment_ids_BxT > 0
        x_BxTxD = x_BxTxD * valid_BxT[..., None].astype(dt)

        qkv_BxTxC = jnp.einsum("btd,dc->btc", x_BxTxD, self.in_proj_qkv[...].astype(dt))
        z_BxTxHxV = jnp.einsum("btd,dc->btc", x_BxTxD, self.in_proj_z[...].astype(dt)).reshape(B, T, Hv, dv)
        b_BxTxH = jnp.einsum("btd,dh->bth", x_BxTxD, self.in_proj_b[...].astype(dt))
        a_BxTxH = jnp.einsum("btd,dh->bth", x_BxTxD, self.in_proj_a[...].astype(dt))
        w_KxC = self.conv_weight[...].astype(dt)

        new_state = None
        if state is None:
            conv_groups = groups_BxT if groups_BxT is not None else jnp.zeros((B, T), jnp.int32)
            conv_BxTxC = causal_depthwise_conv(qkv_BxTxC, w_KxC, conv_groups)
        else:
            conv_state, rec_state = state
            history_BxKxC = conv_state.astype(dt)
            full_BxLxC = jnp.concatenate([history_BxKxC, qkv_BxTxC], axis=1)  # L = K + T
            conv_BxTxC = sum(full_BxLxC[:, 1 + j : 1 + j + T] * w_KxC[None, None, j] for j in range(K))
            # The new conv state is the last K *valid* inputs of each row (pads never enter it).
            n_valid_B = valid_BxT.sum(-1)
            take = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, K, axis=0))
            new_conv = take(full_BxLxC, n_valid_B).astype(conv_state.dtype)
        conv_BxTxC = jax.nn.silu(conv_BxTxC)

        kd = Hk * dk
        q_BxTxHkxK = conv_BxTxC[..., :kd].reshape(B, T, Hk, dk)
        k_BxTxHkxK = conv_BxTxC[..., kd : 2 * kd].reshape(B, T, Hk, dk)
        v_BxTxHxV = conv_BxTxC[..., 2 * kd :].reshape(B, T, Hv, dv)

        beta_BxTxH = jax.nn.sigmoid(b_BxTxH.astype(f32))
        g_BxTxH = -jnp.exp(self.A_log[...].astype(f32))[None, None] * jax.nn.softplus(
            a_BxTxH.astype(f32) + self.dt_bias[...].astype(f32)[None, None]
        )
        # The norm's statistics in float32, the result back in the compute dtype: the delta rule
        # casts each chunk to float32 as it loads it, so float32 copies of q and k (repeated to the
        # value heads) would only be extra activations.
        q_BxTxHkxK = (l2_normalize(q_BxTxHkxK.astype(f32)) * (dk**-0.5)).astype(dt)
        k_BxTxHkxK = l2_normalize(k_BxTxHkxK.astype(f32)).astype(dt)
        # Each key head serves Hv // Hk consecutive value heads.
        q_BxTxHxK = jnp.repeat(q_BxTxHkxK, Hv // Hk, axis=2)
        k_BxTxHxK = jnp.repeat(k_BxTxHkxK, Hv // Hk, axis=2)
        # Pads: no decay, no write, so the state passes through them unchanged.
        g_BxTxH = jnp.where(valid_BxT[..., None], g_BxTxH, 0.0)
        beta_BxTxH = jnp.where(valid_BxT[..., None], beta_BxTxH, 0.0)
        k_BxTxHxK = jnp.where(valid_BxT[..., None, None], k_BxTxHxK, jnp.zeros((), dt))

        if state is not None and T == 1:
            o_BxTxHxV, s_final = recurrent_gated_delta_rule(
                q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, rec_state
            )
        else:
            o_BxTxHxV, s_final = chunked_gated_delta_rule(
                q_BxTxHxK,
                k_BxTxHxK,
                v_BxTxHxV,
                g_BxTxH,
                beta_BxTxH,
                None if state is None else rec_state,
                groups_BxT if state is None else None,
                chunk_size=self.chunk_size,
                kernels=self.kernels,
                out_dtype=dt,
            )
        if state is not None:
            new_state = (new_conv, s_final.astype(f32))

        o_BxTxHxV = o_BxTxHxV.astype(dt)
        normed_BxTxHxV = gated_rms_norm(o_BxTxHxV, z_BxTxHxV, self.norm[...], self.eps)
        out_BxTxD = jnp.einsum(
            "btc,cd->btd", normed_BxTxHxV.reshape(B, T, Hv * dv), self.out_proj[...].astype(dt)
        )
        return out_BxTxD, new_state
