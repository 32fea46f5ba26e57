"""The gated delta rule (Gated DeltaNet's core), state always in float32.

Per value head, with state ``S: [dk, dv]`` and token ``t`` (q already L2-normalised and scaled):

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - k_t^T S))^T
    o_t = q_t^T S

Two forms: ``chunked_gated_delta_rule`` (prefill and training) and ``recurrent_gated_delta_rule``
(one token at a time; decode).

Packing: ``groups`` (int ``[B, T]``, non-decreasing along T) says which tokens share one recurrence.
A token whose group differs from the group of the state it would read starts from a zero state, so
packed sequences never see each other. Callers make padding a no-op by giving pads ``g = 0`` and
``beta = 0`` (and the group of the previous token): then ``S`` passes through them unchanged.

The chunked form, and how its pieces map onto a kernel
------------------------------------------------------
The sequence is cut into chunks of ``C`` tokens (the tail padded with g = beta = 0, a no-op). Within a
chunk, with ``cum`` the cumulative log-decay since the chunk start and ``D[i, j] = exp(cum_i - cum_j)``
for ``j <= i`` in the same group (else 0), the WY/UT form of the delta rule is

    A      = strictly_lower(diag(beta) K K^T * D)                [C, C]
    T      = (I + A)^-1                                          [C, C]   (UT transform)
    k_read = diag(beta * exp(cum) * reads) K,  q_read = diag(exp(cum) * reads) Q
    v_new  = T (diag(beta) V - k_read S)                         [C, dv]  (what each token writes)
    o      = q_read S + (Q K^T * D) v_new                        [C, dv]
    S'     = exp(cum_last) * carried * S + (diag(exp(cum_last - cum) * writes) K)^T v_new

where ``reads`` marks tokens in the group of the incoming state, ``writes`` tokens in the group of the
outgoing one, and ``carried`` whether the whole chunk continues the incoming state. (flash-linear-
attention precomputes ``u = T diag(beta) V`` and ``w = T k_read`` and writes ``v_new = u - w S``; applying
T after the subtraction is the same value with one [C, C] x [C, dk] matmul less, and its backward needs
no ``w``: the CPU form. On accelerators this code precomputes ``u`` and ``w`` too, which leaves two
dependent matmuls per chunk on the sequential chain instead of three: ``_form``.) The code is split
the way a kernel is, as in flash-linear-attention's chunk_gated_delta_rule (a sequential pass over
chunk states, ``fwd_h``; a backward of a sequential ``dh`` pass and parallel per-chunk gradients):

* ``_chunk_masks``: the packing masks of a chunk from its groups and the incoming state's group.
* ``_chunk_prepare``: everything in a chunk that does not depend on the carried state (T, the read
  and write keys, the intra-chunk scores). Parallel over chunks.
* ``_chunk_forward_states``: the sequential forward step ``S -> S'`` (with ``v_new`` and ``q_read S``).
* ``_chunk_outputs``: ``o`` from those. Parallel over chunks.
* ``_chunk_backward_states``: the sequential backward step ``dS' -> dS`` (with ``dv_new``, ``T^T dv_new``).
* ``_chunk_backward``: the gradients of one chunk's q, k, v, g, beta. Parallel over chunks.

``jax.custom_vjp`` gives the chunked form its own backward: the forward saves its inputs (in their own
dtype) and one float32 state per chunk, never anything ``[C, C]``-sized; the backward walks the chunks
in reverse, recomputes each chunk's ``_chunk_prepare``, carries ``dS`` and writes the gradients chunk by
chunk (in the inputs' dtypes). Inputs may be bfloat16: each chunk is cast to float32 as it is loaded.
The inverse is a blocked one (halves recursively, Neumann product on the 16x16 diagonal blocks),
never differentiated: the backward uses ``d(A^-1) = -A^-1 dA A^-1`` directly.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tmax_jax.models.qwen35.numerics import as_bits as _as_bits
from tmax_jax.models.qwen35.numerics import (
    exact_sum_matmul,
    f32_matmul_precision,
    mixed_precision,
    zeros_after,
)
from tmax_jax.models.qwen35.numerics import from_bits as _from_bits
from tmax_jax.target import target_platform

f32 = jnp.float32

# Diagonal blocks up to this size are inverted by a Neumann product; larger ones by halving. The
# product's powers of L grow before they cancel: on keys sharing a direction (beta ~ 1) 16x16 bases
# lose 1.5e-4 of the inverse against float64, 8x8 ones 2.6e-6 (row substitution: 1e-9), and on CPU
# 8 is as fast as 16 (4 is 4x slower: more stacking).
_INVERSE_BASE = 8


def _mm(spec: str, a: jax.Array, b: jax.Array, dt=f32) -> jax.Array:
    """A float32-accumulated matmul whose operands are rounded to ``dt``, the inputs' dtype (see
    ``_operand_dtype``); float32 operands run at the float32-matmul precision."""
    if jnp.dtype(dt) != f32:
        return jnp.einsum(spec, a.astype(dt), b.astype(dt), preferred_element_type=f32)
    return jnp.einsum(spec, a, b, precision=f32_matmul_precision(), preferred_element_type=f32)


def _operand_dtype(*xs: jax.Array):
    """The matmul operand dtype of the chunked form: the inputs' own when they are 16-bit and
    ``numerics.mixed_precision()`` holds, else float32.

    As flash-linear-attention's chunked kernels: the scores, the state's reads and updates, the
    outputs and their gradients take operands in the inputs' dtype with float32 accumulation, while
    the state, the gates' cumulative sums and exponentials, and the triangular inverse stay float32
    (``_unit_lower_inverse``, ``_chunk_cumsum``)."""
    dt = jnp.result_type(*xs)
    return dt if dt.itemsize == 2 and mixed_precision() else f32


# Tests set this to run the accelerator form on CPU: ``(chunks per block, w_form)`` (see ``_form``).
_FORM_OVERRIDE: tuple[int, bool] | None = None


def _form() -> tuple[int, bool]:
    """``(chunks per block, w_form)``: how the loops over the sequence run on this backend.

    Chunks per block: the chunks one loop step handles; their state-independent parts run batched.
    On CPU one chunk per step is fastest (measured at T=2048: batched over 4 chunks the matmuls fall
    out of cache, 3.6x -> 2.7x chunked/recurrent). On accelerators a few chunks per step cut the
    loop's step count and kernel launches; 8 is a guess, not tuned on a device. Temporaries grow with
    it, O(block * C * (C + dk + dv)) per head, never with T.

    ``w_form`` (accelerators): the sequential steps read the state through ``w = T k_read``, computed
    batched before them (flash-linear-attention's form), so each chunk's forward step is two
    dependent matmuls instead of three, and so is its backward step (``T^T dv_new`` moves out of the
    loop). On a GPU the JAX path is bound by how many small kernels run one after another (about
    200,000 per 2B step at 8K tokens on an H100), not by FLOPs. On CPU, which is FLOP-bound here, the
    form without ``w`` does one ``[C, C] x [C, dk]`` matmul per chunk less.
    """
    if _FORM_OVERRIDE is not None:
        return _FORM_OVERRIDE
    return (1, False) if target_platform() == "cpu" else (8, True)


def _unit_lower_inverse(strict_lower: jax.Array) -> jax.Array:
    """``(I + L)^-1`` for strictly lower triangular ``L [..., n, n]``, in matmuls only.

    Up to ``_INVERSE_BASE``: L is nilpotent, so ``(I + L)^-1 = sum_k (-L)^k = prod_i (I + (-L)^(2^i))``,
    ceil(log2 n) - 1 squarings and as many products. Larger: ``[[X, 0], [Y, Z]]`` with ``X, Z`` the
    inverses of the two diagonal halves (computed together, stacked) and ``Y = -Z L21 X``. No row loop
    (whose carries autodiff would save) and no LAPACK triangular solve (which deadlocked XLA's CPU
    runtime at large batch); nothing differentiates through this, the custom VJP does it by hand.
    """
    n = strict_lower.shape[-1]
    if n <= _INVERSE_BASE:
        eye = _lead(jnp.eye(n, dtype=strict_lower.dtype), strict_lower.ndim)
        power = -strict_lower
        inv = eye + power
        for _ in range(max(n - 1, 1).bit_length() - 1):
            power = _mm("...ij,...jk->...ik", power, power)
            inv = inv + _mm("...ij,...jk->...ik", inv, power)
        return inv
    h = n // 2
    l11, l22, l21 = strict_lower[..., :h, :h], strict_lower[..., h:, h:], strict_lower[..., h:, :h]
    if n % 2 == 0:
        both = _unit_lower_inverse(jnp.stack([l11, l22]))
        x11, x22 = both[0], both[1]
    else:
        x11, x22 = _unit_lower_inverse(l11), _unit_lower_inverse(l22)
    x21 = -_mm("...ij,...jk->...ik", x22, _mm("...ij,...jk->...ik", l21, x11))
    top = jnp.concatenate([x11, jnp.zeros(x11.shape[:-1] + (n - h,), x11.dtype)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([x21, x22], axis=-1)], axis=-2)


def _chunk_cumsum(x: jax.Array, reverse: bool = False, dt=f32) -> jax.Array:
    """Cumulative sum over the last axis (a chunk) as a matmul with a triangular 0/1 matrix.

    Same sums as ``jnp.cumsum`` up to float32 rounding order. On XLA CPU, a cumsum becomes a blocked
    reduce-window whose partial sums every consumer re-indexes per element (division and remainder
    by the block). That kept the chunk's ``exp(cum_i - cum_j)`` fusion from vectorising: 2.9 ns per
    element against 0.3 ns from a materialised prefix sum ([32, 8, 64, 64], one process, 2 cores).
    ``reverse``: sums from each position to the end. With 16-bit operands (``dt``) the float32
    ``x`` goes in as three bfloat16 parts against the exact 0/1 matrix: float32 sums in three
    passes (``numerics.exact_sum_matmul``), not six.
    """
    C = x.shape[-1]
    tri = jnp.triu(jnp.ones((C, C), x.dtype))  # [j, i]: j <= i
    if jnp.dtype(dt) != f32:
        return exact_sum_matmul("...j,ji->...i", x, tri.T if reverse else tri)
    return _mm("...j,ji->...i", x, tri.T if reverse else tri)


def _lead(x: jax.Array, ndim: int) -> jax.Array:
    """``x`` with leading 1s up to rank ``ndim`` (explicit broadcasts: strict rank promotion)."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


class ChunkMasks(NamedTuple):
    """Which tokens of a chunk see which state; leading dims ``...`` (e.g. ``[B, 1, M]``)."""

    same: jax.Array  # [..., C, C] bool: j <= i and i, j in one group (the intra-chunk causal mask)
    reads: jax.Array  # [..., C] f32: token reads the state carried into the chunk
    writes: jax.Array  # [..., C] f32: token writes the state carried out of the chunk
    carried: jax.Array  # [...] f32: the incoming state survives to the chunk's end


def _chunk_masks(grp: jax.Array, prev_last: jax.Array) -> ChunkMasks:
    """``grp [..., C]`` int groups of the chunk, ``prev_last [...]`` the group of the incoming state."""
    C = grp.shape[-1]
    last = grp[..., -1]
    causal = jnp.tril(jnp.ones((C, C), bool))
    return ChunkMasks(
        same=(grp[..., :, None] == grp[..., None, :]) & causal.reshape((1,) * (grp.ndim - 1) + (C, C)),
        reads=(grp == prev_last[..., None]).astype(f32),
        writes=(grp == last[..., None]).astype(f32),
        carried=(last == prev_last).astype(f32),
    )


class ChunkPrep(NamedTuple):
    """The state-independent part of a chunk (``_chunk_prepare``); leading dims ``...``."""

    cum: jax.Array  # [..., C] log-decay since the chunk start
    decay: jax.Array  # [..., C, C] D: exp(cum_i - cum_j) on the same-group causal mask, else 0
    t_inv: jax.Array  # [..., C, C] T = (I + A)^-1
    v_beta: jax.Array  # [..., C, dv] diag(beta) V
    kq_read: jax.Array  # [..., 2C, dk] rows :C  k_read = diag(beta exp(cum) reads) K (what S predicts),
    #                                   rows C: q_read = diag(exp(cum) reads) Q (what reads S)
    k_write: jax.Array  # [..., C, dk] diag(exp(cum_last - cum) writes) K (what S' takes in)
    intra: jax.Array  # [..., C, C] P: (Q K^T) * D
    gamma: jax.Array  # [...] exp(cum_last) * carried: the incoming state's decay over the chunk
    # w_form only (else None): u = T v_beta [..., C, dv] and wq_read [..., 2C, dk] = [T k_read; q_read]
    u: jax.Array | None = None
    wq_read: jax.Array | None = None


def _chunk_prepare(q, k, v, g, beta, masks: ChunkMasks, w_form: bool = False, dt=f32) -> ChunkPrep:
    """``q, k [..., C, dk]``, ``v [..., C, dv]``, ``g, beta [..., C]``, all float32; ``w_form`` adds
    ``u`` and ``wq_read`` (see ``_form``)."""
    C = q.shape[-2]
    cum = _chunk_cumsum(g, dt=dt)
    # -inf off the mask: exp gives exactly 0 there and never overflows on the (positive) upper half.
    decay = jnp.exp(jnp.where(masks.same, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    read = jnp.exp(cum) * masks.reads
    kb_q = jnp.concatenate([k * beta[..., None], q], axis=-2)  # [..., 2C, dk]
    # One matmul for both score matrices (same right operand k): [k_beta; q] k^T.
    scores = _mm("...ck,...sk->...cs", kb_q, k, dt)
    scores = scores.reshape(*scores.shape[:-2], 2, C, C) * decay[..., None, :, :]
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    t_inv = _unit_lower_inverse(jnp.where(_lead(strict, scores.ndim - 1), scores[..., 0, :, :], 0.0))
    v_beta = v * beta[..., None]
    kq_read = kb_q * jnp.concatenate([read, read], axis=-1)[..., None]
    u = wq_read = None
    if w_form:
        u = _mm("...cs,...sv->...cv", t_inv, v_beta, dt)
        wq_read = jnp.concatenate(
            [_mm("...cs,...sk->...ck", t_inv, kq_read[..., :C, :], dt), kq_read[..., C:, :]], -2
        )
    return ChunkPrep(
        cum=cum,
        decay=decay,
        t_inv=t_inv,
        v_beta=v_beta,
        kq_read=kq_read,
        k_write=k * (jnp.exp(cum[..., -1:] - cum) * masks.writes)[..., None],
        intra=scores[..., 1, :, :],
        gamma=jnp.exp(cum[..., -1]) * masks.carried,
        u=u,
        wq_read=wq_read,
    )


def _chunk_forward_states(prep: ChunkPrep, s: jax.Array, dt=f32) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One chunk's state step from its incoming state ``s [..., dk, dv]``.

    Returns ``(s_next [..., dk, dv], v_new [..., C, dv], q_s [..., C, dv])`` with
    ``v_new = T (v_beta - k_read s)`` and ``q_s = q_read s`` (one matmul: both read s).
    """
    C = prep.t_inv.shape[-1]
    if prep.wq_read is not None:  # w_form: v_new = u - w s, one matmul fewer on the chain
        wq_s = _mm("...ck,...kv->...cv", prep.wq_read, s, dt)
        v_new = prep.u - wq_s[..., :C, :]
        q_s = wq_s[..., C:, :]
    else:
        kq_s = _mm("...ck,...kv->...cv", prep.kq_read, s, dt)
        v_new = _mm("...cs,...sv->...cv", prep.t_inv, prep.v_beta - kq_s[..., :C, :], dt)
        q_s = kq_s[..., C:, :]
    s_next = s * prep.gamma[..., None, None] + _mm("...ck,...cv->...kv", prep.k_write, v_new, dt)
    return s_next, v_new, q_s


def _chunk_outputs(prep: ChunkPrep, q_s: jax.Array, v_new: jax.Array, dt=f32) -> jax.Array:
    """``o = q_read s + P v_new [..., C, dv]`` from ``_chunk_forward_states``' ``q_s`` and ``v_new``."""
    return q_s + _mm("...cs,...sv->...cv", prep.intra, v_new, dt)


def _chunk_backward_states(prep: ChunkPrep, do: jax.Array, ds_next: jax.Array, dt=f32):
    """One chunk's backward state step.

    ``do [..., C, dv]`` (cotangent of ``o``), ``ds_next [..., dk, dv]`` (of the outgoing state) ->
    ``(ds [..., dk, dv]`` of the incoming state, ``dv_new [..., C, dv]``, ``dr [..., C, dv])`` where
    ``dr = T^T dv_new`` is the cotangent of ``v_beta - k_read s``.
    """
    dv_new = _mm("...cs,...cv->...sv", prep.intra, do, dt) + _mm(
        "...ck,...kv->...cv", prep.k_write, ds_next, dt
    )
    if prep.wq_read is not None:
        # w_form: k_read^T dr = (T k_read)^T dv_new, so ds needs no dr; the caller computes dr
        # (``_chunk_dr``) for all the block's chunks at once, off the sequential chain.
        ds = ds_next * prep.gamma[..., None, None] + _mm(
            "...ck,...cv->...kv", prep.wq_read, jnp.concatenate([-dv_new, do], axis=-2), dt
        )
        return ds, dv_new, None
    dr = _mm("...sc,...sv->...cv", prep.t_inv, dv_new, dt)
    # s is read by k_read (through -dr) and q_read (through do): one matmul over [k_read; q_read].
    ds = ds_next * prep.gamma[..., None, None] + _mm(
        "...ck,...cv->...kv", prep.kq_read, jnp.concatenate([-dr, do], axis=-2), dt
    )
    return ds, dv_new, dr


def _chunk_dr(prep: ChunkPrep, dv_new: jax.Array, dt=f32) -> jax.Array:
    """``dr = T^T dv_new``, the cotangent of ``v_beta - k_read s`` (``_chunk_backward_states``)."""
    return _mm("...sc,...sv->...cv", prep.t_inv, dv_new, dt)


def _chunk_backward(q, k, v, g, beta, masks: ChunkMasks, prep: ChunkPrep, s, do, ds_next, dv_new, dr, dt=f32):
    """Gradients of one chunk's ``(q, k, v, g, beta)`` (shapes as the inputs of ``_chunk_prepare``).

    ``s``: incoming state, ``do``: cotangent of the outputs, ``ds_next``: of the outgoing state,
    ``dv_new, dr``: from ``_chunk_backward_states``. Everything local to the chunk.
    """
    C = q.shape[-2]
    k_read, q_read = prep.kq_read[..., :C, :], prep.kq_read[..., C:, :]
    r = prep.v_beta - _mm("...ck,...kv->...cv", k_read, s, dt)
    v_new = _mm("...cs,...sv->...cv", prep.t_inv, r, dt)
    k_write = prep.k_write
    read = jnp.exp(prep.cum) * masks.reads
    write = jnp.exp(prep.cum[..., -1:] - prep.cum) * masks.writes
    k_beta = k * beta[..., None]

    # o = q_read s + P v_new, s' = gamma s + k_write^T v_new, v_new = T (v_beta - k_read s).
    d_intra = _mm("...cv,...sv->...cs", do, v_new, dt)
    d_qk_read = _mm("...cv,...kv->...ck", jnp.concatenate([do, -dr], axis=-2), s, dt)
    d_q_read, d_k_read = d_qk_read[..., :C, :], d_qk_read[..., C:, :]
    d_k_write = _mm("...cv,...kv->...ck", v_new, ds_next, dt)
    d_gamma = jnp.sum(s * ds_next, axis=(-2, -1))
    # T = (I + A)^-1: dT = dv_new r^T, dA = -T^T dT T^T (strictly lower part).
    d_t = _mm("...cv,...sv->...cs", dv_new, r, dt)
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    d_a = -_mm("...sc,...sd->...cd", prep.t_inv, _mm("...cs,...ds->...cd", d_t, prep.t_inv, dt), dt)
    d_a = jnp.where(_lead(strict, d_a.ndim), d_a, 0.0)
    # A = strict(k_beta k^T * D), P = (q k^T) * D.
    d_kbk = d_a * prep.decay
    d_qk = d_intra * prep.decay
    # D enters both products; the raw ones are recomputed (dividing D back out of P is unsafe).
    kb_q = jnp.concatenate([k_beta, q], axis=-2)
    raw = _mm("...ck,...sk->...cs", kb_q, k, dt)
    d_decay = d_a * raw[..., :C, :] + d_intra * raw[..., C:, :]

    d_k_beta = _mm("...cs,...sk->...ck", d_kbk, k, dt) + d_k_read * read[..., None]
    dq = _mm("...cs,...sk->...ck", d_qk, k, dt) + d_q_read * read[..., None]
    # k enters both score matrices as the right operand: [d_kbk; d_qk]^T [k_beta; q] in one matmul.
    dk = (
        _mm("...cs,...ck->...sk", jnp.concatenate([d_kbk, d_qk], axis=-2), kb_q, dt)
        + d_k_write * write[..., None]
        + d_k_beta * beta[..., None]
    )
    dv = dr * beta[..., None]
    dbeta = jnp.sum(d_k_beta * k, axis=-1) + jnp.sum(dr * v, axis=-1)

    # cum enters D (as cum_i - cum_j), the read factor exp(cum), the write factor exp(cum_last - cum)
    # and gamma = exp(cum_last) * carried.
    x = d_decay * prep.decay
    d_cum = jnp.sum(x, axis=-1) - jnp.sum(x, axis=-2)
    d_cum = d_cum + jnp.sum(d_q_read * q_read, axis=-1) + jnp.sum(d_k_read * k_read, axis=-1)
    from_write = jnp.sum(d_k_write * k_write, axis=-1)
    d_last = jnp.sum(from_write, axis=-1) + d_gamma * prep.gamma
    d_cum = d_cum - from_write
    d_cum = d_cum.at[..., -1].add(d_last)
    dg = _chunk_cumsum(d_cum, reverse=True, dt=dt)  # cum = cumsum(g)
    return dq, dk, dv, dg, dbeta


def _block_count(n_chunks: int, per_block: int) -> int:
    """Chunks per block: the largest divisor of ``n_chunks`` not above ``per_block``."""
    return max(d for d in range(1, min(per_block, n_chunks) + 1) if n_chunks % d == 0)


def _load(x: jax.Array, dtype, n0, m: int, C: int) -> jax.Array:
    """Chunks ``[n0, n0 + m)`` of ``x [B, N * C, H, ...]`` (``_as_bits`` of ``dtype``) as float32
    ``[B, H, m, C, ...]``; the cast happens here, per block, so no float32 copy of the sequence exists."""
    x = _from_bits(jax.lax.dynamic_slice_in_dim(x, n0 * C, m * C, axis=1), dtype).astype(f32)
    x = x.reshape(x.shape[0], m, C, *x.shape[2:])
    return jnp.moveaxis(x, 3, 1)


def _store(buf: jax.Array, x: jax.Array, dtype, n0, C: int) -> jax.Array:
    """Write ``x [B, H, m, C, ...]`` as ``dtype`` into ``buf [B, N * C, H, ...]`` (``_as_bits``) at chunk n0."""
    x = _as_bits(jnp.moveaxis(x, 1, 3).astype(dtype))
    x = x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])
    return jax.lax.dynamic_update_slice_in_dim(buf, x, n0 * C, axis=1)


def _pad_time(x: jax.Array, C: int, edge: bool = False) -> jax.Array:
    """Pads ``[B, T, ...]`` to a multiple of C tokens (zeros, or the last value for groups)."""
    pad = (-x.shape[1]) % C
    if not pad:
        return x
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode="edge" if edge else "constant")


def _block_inputs(seqs, dtypes, grp, prev_last, n0, m: int, C: int):
    q, k, v, g, beta = (
        _load(x, dt, n0, m, C) for x, dt in zip(seqs, dtypes)
    )  # [B, H, m, C, (K|V)], [B, H, m, C]
    grp_b = jax.lax.dynamic_slice_in_dim(grp, n0, m, axis=1)[:, None]  # [B, 1, m, C]
    prev_b = jax.lax.dynamic_slice_in_dim(prev_last, n0, m, axis=1)[:, None]  # [B, 1, m]
    return (q, k, v, g, beta), _chunk_masks(grp_b, prev_b)


def _groups(groups: jax.Array, C: int) -> tuple[jax.Array, jax.Array]:
    """Chunked groups ``[B, N, C]`` (the padded tail joins the last group) and, per chunk, the group of
    its incoming state ``[B, N]`` (chunk 0: the initial state's, 0)."""
    B = groups.shape[0]
    grp = _pad_time(groups.astype(jnp.int32), C, edge=True).reshape(B, -1, C)
    prev_last = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), grp[:, :-1, -1]], axis=1)
    return grp, prev_last


def _slice_chunk(tree, i: int):
    """Chunk ``i`` of a block's per-chunk tree (chunk axis 2 of every leaf)."""
    return jax.tree.map(lambda x: x[:, :, i], tree)


def _forward(
    q,
    k,
    v,
    g,
    beta,
    s0,
    groups,
    C: int,
    per_block: int,
    save_states: bool,
    out_dtype=f32,
    w_form: bool = False,
):
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtypes = tuple(x.dtype for x in (q, k, v, g, beta))
    dt = _operand_dtype(q, k, v)
    seqs = tuple(_as_bits(_pad_time(x, C)) for x in (q, k, v, g, beta))  # [B, N * C, H, ...]
    grp, prev_last = _groups(groups, C)
    N = grp.shape[1]
    m = _block_count(N, per_block)

    def block(carry, n0):
        s, out, saved = carry
        x, masks = _block_inputs(seqs, dtypes, grp, prev_last, n0, m, C)
        prep = _chunk_prepare(*x, masks, w_form=w_form, dt=dt)
        states, v_new, q_s = [], [], []
        for i in range(m):
            states.append(s)
            s, v_new_i, q_s_i = _chunk_forward_states(_slice_chunk(prep, i), s, dt)
            v_new.append(v_new_i)
            q_s.append(q_s_i)
        if save_states:  # each chunk's incoming state, [N // m, B, H, m, K, V]
            saved = jax.lax.dynamic_update_index_in_dim(saved, jnp.stack(states, axis=2), n0 // m, 0)
        o = _chunk_outputs(prep, jnp.stack(q_s, axis=2), jnp.stack(v_new, axis=2), dt)
        out = _store(out, o, out_dtype, n0, C)
        return (s, out, saved), None

    # Loop buffers tied to this call's data (numerics.zeros_after), not shared zero constants.
    out0 = _as_bits(zeros_after((B, N * C, H, V), out_dtype, g))
    saved0 = zeros_after((N // m, B, H, m, K, V) if save_states else (), f32, g)
    (s_final, out, states), _ = jax.lax.scan(block, (s0, out0, saved0), jnp.arange(0, N, m))
    out = _from_bits(out, out_dtype)
    return (out[:, :T] if N * C != T else out), s_final, (states if save_states else None)


def _backward(res, cotangents, C: int, per_block: int, w_form: bool = False):
    q, k, v, g, beta, groups, states = res
    d_out, d_final = cotangents
    T = k.shape[1]
    dtypes = tuple(x.dtype for x in (q, k, v, g, beta))
    dt = _operand_dtype(q, k, v)
    seqs = tuple(_as_bits(_pad_time(x, C)) for x in (q, k, v, g, beta))
    grp, prev_last = _groups(groups, C)
    N = grp.shape[1]
    d_out_dtype = d_out.dtype
    # Gradient buffers tied to this call's cotangent (numerics.zeros_after), not shared constants.
    grads0 = tuple(_as_bits(zeros_after(x.shape, dt, d_out)) for x, dt in zip(seqs, dtypes))
    d_out = _as_bits(_pad_time(d_out, C))  # [B, N * C, H, V]
    m = _block_count(N, per_block)

    def block(carry, xs):
        ds, grads = carry
        n0, s_in = xs  # s_in [B, H, m, K, V]
        x, masks = _block_inputs(seqs, dtypes, grp, prev_last, n0, m, C)
        prep = _chunk_prepare(*x, masks, w_form=w_form, dt=dt)
        do = _load(d_out, d_out_dtype, n0, m, C)
        ds_next, dv_new, dr = [None] * m, [None] * m, [None] * m
        for i in reversed(range(m)):
            ds_next[i] = ds
            ds, dv_new[i], dr[i] = _chunk_backward_states(_slice_chunk(prep, i), do[:, :, i], ds, dt)
        ds_next, dv_new = (jnp.stack(x, axis=2) for x in (ds_next, dv_new))
        dr = _chunk_dr(prep, dv_new, dt) if w_form else jnp.stack(dr, axis=2)
        d_x = _chunk_backward(*x, masks, prep, s_in, do, ds_next, dv_new, dr, dt)
        grads = tuple(_store(buf, d, dt, n0, C) for buf, d, dt in zip(grads, d_x, dtypes))
        return (ds, grads), None

    (ds0, grads), _ = jax.lax.scan(
        block, (d_final.astype(f32), grads0), (jnp.arange(0, N, m), states), reverse=True
    )
    grads = tuple(_from_bits(x, dt) for x, dt in zip(grads, dtypes))
    if N * C != T:
        grads = tuple(x[:, :T] for x in grads)
    return (*grads, ds0, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _chunked(q, k, v, g, beta, s0, groups, C, out_dtype):
    per_block, w_form = _form()
    out, s_final, _ = _forward(
        q, k, v, g, beta, s0, groups, C, per_block, save_states=False, out_dtype=out_dtype, w_form=w_form
    )
    return out, s_final


def _chunked_fwd(q, k, v, g, beta, s0, groups, C, out_dtype):
    per_block, w_form = _form()
    out, s_final, states = _forward(
        q, k, v, g, beta, s0, groups, C, per_block, save_states=True, out_dtype=out_dtype, w_form=w_form
    )
    return (out, s_final), (q, k, v, g, beta, groups, states)


def _chunked_bwd(C, out_dtype, res, cotangents):
    per_block, w_form = _form()
    return _backward(res, cotangents, C, per_block, w_form=w_form)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def check_shapes(q, k, v, g, beta, s0, groups, chunk_size) -> None:
    """ValueErrors naming the input whose shape or dtype breaks the delta rule's contract."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if k.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, dk], got q {q.shape} and k {k.shape}")
    B, T, H, K = k.shape
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, dv] = [{B}, {T}, {H}, dv], got {v.shape}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H):
            raise ValueError(f"{name} must be [B, T, H] = {(B, T, H)}, got {x.shape}")
    if s0 is not None and s0.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, dk, dv] = {(B, H, K, v.shape[-1])}, got {s0.shape}")
    if groups is not None and groups.shape != (B, T):
        raise ValueError(f"groups must be [B, T] = {(B, T)}, got {groups.shape}")
    if groups is not None and not jnp.issubdtype(groups.dtype, jnp.integer):
        raise ValueError(f"groups must be integer, got {groups.dtype}")


def chunked_gated_delta_rule(
    q_BxTxHxK: jax.Array,
    k_BxTxHxK: jax.Array,
    v_BxTxHxV: jax.Array,
    g_BxTxH: jax.Array,
    beta_BxTxH: jax.Array,
    initial_state_BxHxKxV: jax.Array | None = None,
    groups_BxT: jax.Array | None = None,
    chunk_size: int = 64,
    *,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """Returns ``(out [B, T, H, dv] float32, final_state [B, H, dk, dv] float32)``.

    ``out_dtype``: the output's dtype (default float32). Each chunk's output is computed in float32 and
    stored as ``out_dtype``; a layer that casts the output to its compute dtype anyway passes that
    dtype here, and no float32 ``[B, T, H, dv]`` buffer (nor its float32 cotangent) exists.

    The initial state belongs to group 0: tokens of group 0 read it, others start from zero. Inputs may
    be bfloat16 (each block is cast to float32 as it is used; under the "mixed" policy the matmuls take
    bfloat16 operands, ``_operand_dtype``); gradients come back in the inputs' dtypes.
    """
    check_shapes(
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, initial_state_BxHxKxV, groups_BxT, chunk_size
    )
    B, T, H, K = k_BxTxHxK.shape
    V = v_BxTxHxV.shape[-1]
    if initial_state_BxHxKxV is None:
        s0 = jnp.zeros((B, H, K, V), f32)
    else:
        s0 = initial_state_BxHxKxV.astype(f32)
    if groups_BxT is None:
        groups_BxT = jnp.zeros((B, T), jnp.int32)
    out_dtype = f32 if out_dtype is None else jnp.dtype(out_dtype)
    return _chunked(
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, s0, groups_BxT, chunk_size, out_dtype
    )


def recurrent_gated_delta_rule(
    q_BxTxHxK: jax.Array,
    k_BxTxHxK: jax.Array,
    v_BxTxHxV: jax.Array,
    g_BxTxH: jax.Array,
    beta_BxTxH: jax.Array,
    initial_state_BxHxKxV: jax.Array | None = None,
    *,
    all_states: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token form (decode); same contract as the chunked one without packing.
    ``all_states``: the state after every token, float32 ``[B, T, H, K, V]``, instead of the last
    one (speculative decoding keeps the state after the last accepted token)."""
    B, T, H, K = k_BxTxHxK.shape
    V = v_BxTxHxV.shape[-1]
    if initial_state_BxHxKxV is None:
        s0 = jnp.zeros((B, H, K, V), f32)
    else:
        s0 = initial_state_BxHxKxV.astype(f32)

    def step(s, xs):
        # S' = d S + k (beta (v - k^T d S))^T with d = exp(g), and o = q^T S' = d q^T S + (q.k) delta:
        # S is read once (one matmul for k^T S and q^T S) and read and written once (the update), not
        # decayed, read, updated and read again (four passes over the state, which at decode is most
        # of the rule's memory traffic).
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, K], [B, H, K], [B, H, V], [B, H], [B, H]
        decay = jnp.exp(g_t)[..., None]  # [B, H, 1]
        kq_s = _mm("bhnk,bhkv->bhnv", jnp.stack([k_t, q_t], axis=2), s)  # [B, H, 2, V]
        delta = (v_t - decay * kq_s[:, :, 0]) * b_t[..., None]
        s = s * decay[..., None] + k_t[..., :, None] * delta[..., None, :]
        return s, decay * kq_s[:, :, 1] + jnp.sum(q_t * k_t, axis=-1, keepdims=True) * delta

    xs = tuple(
        jnp.moveaxis(x.astype(f32), 1, 0) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH)
    )
    if T == 1 and not all_states:  # decode: no scan machinery for a single step
        s_final, o_t = step(s0, tuple(x[0] for x in xs))
        return o_t[:, None], s_final
    if all_states:  # a few tokens (a speculative verify step): unrolled
        s, outs, states = s0, [], []
        for t in range(T):
            s, o_t = step(s, tuple(x[t] for x in xs))
            outs.append(o_t)
            states.append(s)
        return jnp.stack(outs, axis=1), jnp.stack(states, axis=1)
    s_final, o = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 1), s_final
