"""The gated delta rule (Gated DeltaNet's core), state always in float32.

Per value head, with state ``S: [dk, dv]`` and token ``t`` (q already L2-normalised and scaled):

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - k_t^T S))^T
    o_t = q_t^T S

Two forms: ``chunked_gated_delta_rule`` (prefill and training; WY/UT transform inside chunks of 64,
a scan over chunks) and ``recurrent_gated_delta_rule`` (one token at a time; decode).

Packing: ``groups`` (int ``[B, T]``, non-decreasing along T) says which tokens share one recurrence.
A token whose group differs from the group of the state it would read starts from a zero state, so
packed sequences never see each other. Callers make padding a no-op by giving pads ``g = 0`` and
``beta = 0`` (and the group of the previous token): then ``S`` passes through them unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tmax_jax.models.qwen35.numerics import f32_matmul_precision

f32 = jnp.float32


def _mm(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=f32_matmul_precision(), preferred_element_type=f32)


def _unit_lower_inverse(strict_lower: jax.Array) -> jax.Array:
    """``(I + L)^-1`` for strictly lower triangular ``L [..., C, C]`` by forward substitution.

    Row i of the inverse is ``e_i - L[i] @ inv``; rows >= i still hold ``e_j`` then, and L[i, j>=i]
    is zero, so one pass over the rows is exact. Plain matmuls: no LAPACK triangular-solve custom
    call (which deadlocked XLA's CPU runtime at large batch) and it runs the same on TPU and GPU.
    """
    C = strict_lower.shape[-1]
    eye = jnp.eye(C, dtype=strict_lower.dtype)

    def row(i, inv):
        r = eye[i] - _mm("...j,...jk->...k", jax.lax.dynamic_index_in_dim(strict_lower, i, -2, False), inv)
        return jax.lax.dynamic_update_index_in_dim(inv, r, i, -2)

    return jax.lax.fori_loop(0, C, row, jnp.broadcast_to(eye, strict_lower.shape))


def chunked_gated_delta_rule(
    q_BxTxHxK: jax.Array,
    k_BxTxHxK: jax.Array,
    v_BxTxHxV: jax.Array,
    g_BxTxH: jax.Array,
    beta_BxTxH: jax.Array,
    initial_state_BxHxKxV: jax.Array | None = None,
    groups_BxT: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """Returns ``(out [B, T, H, dv] float32, final_state [B, H, dk, dv] float32)``.

    The initial state belongs to group 0: tokens of group 0 read it, others start from zero.
    """
    B, T, H, K = k_BxTxHxK.shape
    V = v_BxTxHxV.shape[-1]
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C
    if groups_BxT is None:
        groups_BxT = jnp.zeros((B, T), jnp.int32)

    def to_chunks(x, fill_edge=False):
        x = x.astype(f32) if not fill_edge else x
        widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        x = jnp.pad(x, widths, mode="edge" if fill_edge else "constant")
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1) if x.ndim > 3 else x  # heads first: [B, H, N, C, ...]

    q = to_chunks(q_BxTxHxK)  # [B, H, N, C, K]
    k = to_chunks(k_BxTxHxK)
    v = to_chunks(v_BxTxHxV)  # [B, H, N, C, V]
    g = to_chunks(g_BxTxH)  # [B, H, N, C]
    beta = to_chunks(beta_BxTxH)
    # Padded tail tokens join the last group; with g = beta = 0 they leave the state untouched.
    grp = to_chunks(groups_BxT.astype(jnp.int32), fill_edge=True)[:, None]  # [B, 1, N, C]

    prev_last = jnp.concatenate([jnp.zeros_like(grp[:, :, :1, -1]), grp[:, :, :-1, -1]], axis=2)  # [B,1,N]
    cont = (grp == prev_last[..., None]).astype(f32)  # token reads the state carried into its chunk
    last = grp[..., -1]  # [B, 1, N]
    in_last = (grp == last[..., None]).astype(f32)  # token writes the state carried out of its chunk
    chunk_cont = (last == prev_last).astype(f32)  # the whole chunk continues the carried state

    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C] log-decay since chunk start
    causal = jnp.tril(jnp.ones((C, C), bool))
    same = (grp[..., :, None] == grp[..., None, :]) & causal  # [B, 1, N, C, C]
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(same, jnp.exp(jnp.where(same, diff, 0.0)), 0.0)  # [B, H, N, C, C]

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    # T = (I + strictly_lower(diag(beta) K K^T * decay))^-1, the UT transform of the chunk.
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    a_strict = jnp.where(strict, _mm("bhnck,bhnsk->bhncs", k_beta, k) * decay, 0.0)
    t_inv = _unit_lower_inverse(a_strict)
    u = _mm("bhncs,bhnsv->bhncv", t_inv, v_beta)
    w = _mm("bhncs,bhnsk->bhnck", t_inv, k_beta * (jnp.exp(cum) * cont)[..., None])
    intra = _mm("bhnck,bhnsk->bhncs", q, k) * decay
    q_read = q * (jnp.exp(cum) * cont)[..., None]
    k_write = k * (jnp.exp(cum[..., -1:] - cum) * in_last)[..., None]
    state_decay = jnp.exp(cum[..., -1]) * chunk_cont  # [B, H, N]

    if initial_state_BxHxKxV is None:
        s0 = jnp.zeros((B, H, K, V), f32)
    else:
        s0 = initial_state_BxHxKxV.astype(f32)

    def step(s_BxHxKxV, xs):
        u_n, w_n, q_n, k_n, intra_n, decay_n = xs
        v_new = u_n - _mm("bhck,bhkv->bhcv", w_n, s_BxHxKxV)
        o_n = _mm("bhck,bhkv->bhcv", q_n, s_BxHxKxV) + _mm("bhcs,bhsv->bhcv", intra_n, v_new)
        s_next = s_BxHxKxV * decay_n[..., None, None] + _mm("bhck,bhcv->bhkv", k_n, v_new)
        return s_next, o_n

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_read, k_write, intra, state_decay))
    s_final, o = jax.lax.scan(step, s0, xs)  # o: [N, B, H, C, V]
    o_BxTxHxV = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, N * C, H, V)[:, :T]
    return o_BxTxHxV, s_final


def recurrent_gated_delta_rule(
    q_BxTxHxK: jax.Array,
    k_BxTxHxK: jax.Array,
    v_BxTxHxV: jax.Array,
    g_BxTxH: jax.Array,
    beta_BxTxH: jax.Array,
    initial_state_BxHxKxV: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token form (decode); same contract as the chunked one without packing."""
    B, T, H, K = k_BxTxHxK.shape
    V = v_BxTxHxV.shape[-1]
    if initial_state_BxHxKxV is None:
        s0 = jnp.zeros((B, H, K, V), f32)
    else:
        s0 = initial_state_BxHxKxV.astype(f32)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, K], [B, H, K], [B, H, V], [B, H], [B, H]
        s = s * jnp.exp(g_t)[..., None, None]
        predicted = _mm("bhk,bhkv->bhv", k_t, s)
        delta = (v_t - predicted) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, _mm("bhk,bhkv->bhv", q_t, s)

    xs = tuple(
        jnp.moveaxis(x.astype(f32), 1, 0) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH)
    )
    if T == 1:  # decode: no scan machinery for a single step
        s_final, o_t = step(s0, tuple(x[0] for x in xs))
        return o_t[:, None], s_final
    s_final, o = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 1), s_final
