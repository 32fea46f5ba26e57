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
from tmax_jax.models.qwen35.numerics import as_bits, from_bits, zeros_after
from tmax_jax.models.qwen35.params import constant, log_uniform, make_param, normal
from tmax_jax.models.qwen35.remat import TOKEN_CHUNK, recompute_in_backward, tokenwise_chunked

f32 = jnp.float32


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


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
    lags = min(K, T) - 1
    # One padded copy read at every lag (not one padded copy per lag: the op is memory-bound).
    x_p = jnp.pad(x_BxTxC, ((0, 0), (lags, 0), (0, 0)))
    g_p = jnp.pad(groups_BxT, ((0, 0), (lags, 0)), constant_values=-1)
    out = x_BxTxC * w_KxC[None, None, K - 1]
    for lag in range(1, lags + 1):
        same = (g_p[:, lags - lag : lags - lag + T] == groups_BxT)[..., None].astype(x_BxTxC.dtype)
        out = out + x_p[:, lags - lag : lags - lag + T] * same * w_KxC[None, None, K - 1 - lag]
    return out


def _conv_fwd(x_BxTxC, w_KxC, groups_BxT):
    return causal_depthwise_conv(x_BxTxC, w_KxC, groups_BxT), (x_BxTxC, w_KxC, groups_BxT)


def _conv_bwd(res, d_BxTxC):
    x, w, groups = res
    K, T = w.shape[0], x.shape[1]
    lags = min(K, T) - 1
    # dx[t] = sum_lag d[t + lag] [same group] w[K-1-lag]: one copy of d padded at the end, every lag
    # read from it.
    d_e = jnp.pad(d_BxTxC, ((0, 0), (0, lags), (0, 0)))
    g_e = jnp.pad(groups, ((0, 0), (0, lags)), constant_values=-1)
    dx = d_BxTxC * w[None, None, K - 1]
    for lag in range(1, lags + 1):
        same = (g_e[:, lag : lag + T] == groups)[..., None].astype(x.dtype)
        dx = dx + d_e[:, lag : lag + T] * same * w[None, None, K - 1 - lag]
    # dw[j] = sum_t d[t] x[t - (K-1) + j] (same group), block by block over time.
    Tb = min(_CONV_GRAD_BLOCK, T)
    pad = (-T) % Tb
    # Sliced as bits (numerics.as_bits): a 16-bit slice in the loop would be a float32 copy of all T.
    x_p = as_bits(jnp.pad(x, ((0, 0), (K - 1, pad), (0, 0))))
    g_p = jnp.pad(groups, ((0, 0), (K - 1, pad)), constant_values=-1)
    d_p = as_bits(jnp.pad(d_BxTxC, ((0, 0), (0, pad), (0, 0))))
    gd_p = jnp.pad(groups, ((0, 0), (0, pad)), constant_values=-2)

    def block(acc_KxC, t0):
        d_b = from_bits(jax.lax.dynamic_slice_in_dim(d_p, t0, Tb, axis=1), d_BxTxC.dtype)
        g_b = jax.lax.dynamic_slice_in_dim(gd_p, t0, Tb, axis=1)
        x_w = from_bits(jax.lax.dynamic_slice_in_dim(x_p, t0, Tb + K - 1, axis=1), x.dtype)
        g_w = jax.lax.dynamic_slice_in_dim(g_p, t0, Tb + K - 1, axis=1)
        taps = []
        for j in range(K):
            prod = x_w[:, j : j + Tb] * d_b
            if j < K - 1:
                prod = jnp.where((g_w[:, j : j + Tb] == g_b)[..., None], prod, jnp.zeros((), prod.dtype))
            taps.append(jnp.sum(prod.astype(f32), axis=(0, 1)))
        return acc_KxC + jnp.stack(taps), None

    dw, _ = jax.lax.scan(block, zeros_after(w.shape, f32, d_BxTxC), jnp.arange(0, T + pad, Tb))
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
        self.token_chunk = TOKEN_CHUNK
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

    def _weights(self) -> dict:
        return {
            "qkv": self.in_proj_qkv[...],
            "z": self.in_proj_z[...],
            "b": self.in_proj_b[...],
            "a": self.in_proj_a[...],
            "conv": self.conv_weight[...],
            "dt_bias": self.dt_bias[...],
            "A_log": self.A_log[...],
            "norm": self.norm[...],
            "out": self.out_proj[...],
        }

    def __call__(
        self,
        x_BxTxD: jax.Array,
        segment_ids_BxT: jax.Array,
        groups_BxT: jax.Array | None,
        *,
        state: tuple[jax.Array, jax.Array] | None = None,
        stages: bool = False,
        keep_states: bool = False,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """``state`` = (conv ``[B, K, conv_dim]``, recurrent ``[B, Hv, dk, dv]`` float32) or None.

        ``stages`` (training without a cache; ``remat="full"``): the input projections and, after the
        delta rule, the gated norm and output projection run in chunks of ``token_chunk`` tokens with
        their own backward (remat.tokenwise_chunked), and the conv and head norms are a checkpoint
        recomputed in its own backward pass, so the backward holds one stage's internals at a time
        beside the delta rule's inputs and outputs.

        ``keep_states`` (with ``state``; every token valid): the new state is the one after each
        token, conv ``[B, T, K, conv_dim]`` and recurrent ``[B, T, Hv, dk, dv]``."""
        w = self._weights()
        if state is not None:
            return self._with_state(w, x_BxTxD, segment_ids_BxT, state, keep_states)
        B, T, _ = x_BxTxD.shape
        consts = (segment_ids_BxT, groups_BxT if groups_BxT is not None else jnp.zeros((B, T), jnp.int32))
        x_BxTxD = x_BxTxD * (segment_ids_BxT > 0)[..., None].astype(self.dtype)
        w_proj = {k: w[k] for k in ("qkv", "z", "b", "a")}
        w_heads = {k: w[k] for k in ("conv", "dt_bias", "A_log")}
        w_post = {k: w[k] for k in ("norm", "out")}
        if stages:
            qkv, z, b, a = tokenwise_chunked(self._projections, w_proj, x_BxTxD, self.token_chunk)
            q, k, v, g, beta = recompute_in_backward(self._conv_heads, w_heads, (qkv, b, a), consts)
        else:
            qkv, z, b, a = self._projections(w_proj, x_BxTxD)
            q, k, v, g, beta = self._conv_heads(w_heads, (qkv, b, a), consts)
        o, _ = self._chunked(q, k, v, g, beta, None, groups_BxT)
        if stages:
            return tokenwise_chunked(self._post, w_post, (o, z), self.token_chunk), None
        return self._post(w_post, (o, z)), None

    def _chunked(self, q, k, v, g, beta, s0, groups):
        """The chunked delta rule at this layer's chunk size and kernels, output in the compute dtype."""
        return chunked_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            s0,
            groups,
            chunk_size=self.chunk_size,
            kernels=self.kernels,
            out_dtype=self.dtype,
        )

    def _projections(self, w, x_BxTxD):
        """(qkv, z, b, a) of ``x`` whose pad tokens the caller has zeroed."""
        dt = self.dtype
        B, T, _ = x_BxTxD.shape
        qkv_BxTxC = jnp.einsum("btd,dc->btc", x_BxTxD, w["qkv"].astype(dt))
        z_BxTxHxV = jnp.einsum("btd,dc->btc", x_BxTxD, w["z"].astype(dt)).reshape(
            B, T, self.num_v_heads, self.dv
        )
        b_BxTxH = jnp.einsum("btd,dh->bth", x_BxTxD, w["b"].astype(dt))
        a_BxTxH = jnp.einsum("btd,dh->bth", x_BxTxD, w["a"].astype(dt))
        return qkv_BxTxC, z_BxTxHxV, b_BxTxH, a_BxTxH

    def _heads(self, w, conv_BxTxC, b_BxTxH, a_BxTxH, valid_BxT):
        """(q, k [B, T, Hv, dk] compute dtype, v [B, T, Hv, dv], g, beta [B, T, Hv] float32) from the
        conv's output (before its SiLU) and the b/a projections; pads neither decay nor write."""
        dt = self.dtype
        B, T, _ = conv_BxTxC.shape
        Hk, Hv, dk, dv = self.num_k_heads, self.num_v_heads, self.dk, self.dv
        conv_BxTxC = jax.nn.silu(conv_BxTxC)
        kd = Hk * dk
        q_BxTxHkxK = conv_BxTxC[..., :kd].reshape(B, T, Hk, dk)
        k_BxTxHkxK = conv_BxTxC[..., kd : 2 * kd].reshape(B, T, Hk, dk)
        v_BxTxHxV = conv_BxTxC[..., 2 * kd :].reshape(B, T, Hv, dv)

        beta_BxTxH = jax.nn.sigmoid(b_BxTxH.astype(f32))
        g_BxTxH = -jnp.exp(w["A_log"].astype(f32))[None, None] * jax.nn.softplus(
            a_BxTxH.astype(f32) + w["dt_bias"].astype(f32)[None, None]
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
        return q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH

    def _conv_heads(self, w, qkv_b_a, consts):
        """The delta rule's inputs from the projections (training, no cache)."""
        qkv, b, a = qkv_b_a
        segment_ids_BxT, groups_BxT = consts
        conv = causal_depthwise_conv(qkv, w["conv"].astype(self.dtype), groups_BxT)
        return self._heads(w, conv, b, a, segment_ids_BxT > 0)

    def _post(self, w, oz):
        """``out_proj(gated_norm(o, z))``."""
        o_BxTxHxV, z_BxTxHxV = oz
        dt = self.dtype
        B, T = o_BxTxHxV.shape[:2]
        normed_BxTxHxV = gated_rms_norm(o_BxTxHxV.astype(dt), z_BxTxHxV, w["norm"], self.eps)
        return jnp.einsum("btc,cd->btd", normed_BxTxHxV.reshape(B, T, -1), w["out"].astype(dt))

    def _with_state(self, w, x_BxTxD, segment_ids_BxT, state, keep_states=False):
        """Prefill into a cache, or decode: the conv continues from the cached inputs, the delta rule
        from the cached state."""
        dt = self.dtype
        B, T, _ = x_BxTxD.shape
        K = self.kernel
        valid_BxT = segment_ids_BxT > 0
        x_BxTxD = x_BxTxD * valid_BxT[..., None].astype(dt)
        qkv_BxTxC, z_BxTxHxV, b_BxTxH, a_BxTxH = self._projections(w, x_BxTxD)
        w_KxC = w["conv"].astype(dt)
        conv_state, rec_state = state
        history_BxKxC = conv_state.astype(dt)
        full_BxLxC = jnp.concatenate([history_BxKxC, qkv_BxTxC], axis=1)  # L = K + T
        conv_BxTxC = sum(full_BxLxC[:, 1 + j : 1 + j + T] * w_KxC[None, None, j] for j in range(K))
        # The new conv state is the last K *valid* inputs of each row (pads never enter it).
        n_valid_B = valid_BxT.sum(-1)
        take = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, K, axis=0))
        new_conv = take(full_BxLxC, n_valid_B).astype(conv_state.dtype)
        q, k, v, g, beta = self._heads(w, conv_BxTxC, b_BxTxH, a_BxTxH, valid_BxT)
        if keep_states:
            o_BxTxHxV, s_all = recurrent_gated_delta_rule(q, k, v, g, beta, rec_state, all_states=True)
            conv_all = jnp.stack([full_BxLxC[:, t + 1 : t + 1 + K] for t in range(T)], axis=1)
            out = self._post(w, (o_BxTxHxV, z_BxTxHxV))
            return out, (conv_all.astype(conv_state.dtype), s_all)
        if T == 1:
            o_BxTxHxV, s_final = recurrent_gated_delta_rule(q, k, v, g, beta, rec_state)
        else:
            o_BxTxHxV, s_final = self._chunked(q, k, v, g, beta, rec_state, None)
        out = self._post(w, (o_BxTxHxV, z_BxTxHxV))
        return out, (new_conv, s_final.astype(f32))
