"""Blockwise (flash-style) masked GQA attention with its own backward pass, in O(T) memory.

The forward runs an online softmax over key blocks for each query block and keeps only the output and
the per-row log-sum-exp; the backward recomputes each block's probabilities from them. Key blocks that
no query of the block may see (causality, packing) are skipped in both passes.

Layouts: q ``[B, T, G, R, E]`` (G kv heads, R query heads per kv head), k/v ``[B, S, G, E]``. Query t
sees key s iff ``k_idx[s] <= q_idx[t]`` and ``k_seg[b, s] == q_seg[b, t]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tmax_jax.models.qwen35.numerics import scan_into, zeros_after

f32 = jnp.float32
# Finite: a row that sees no key gets a uniform (not NaN) distribution, as in the unblocked form.
MASKED = -0.7 * float(jnp.finfo(f32).max)
_FAR = jnp.iinfo(jnp.int32).max  # key index of padding keys: later than every query


def _pad_to(x, n, axis, value):
    pad = n - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _split(x, block, axis):
    """``[..., n*block, ...]`` -> ``[n, ..., block, ...]`` (the block count leads)."""
    shape = x.shape
    x = x.reshape(*shape[:axis], shape[axis] // block, block, *shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _merge(x, axis):
    """Inverse of ``_split``."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])


def _mask(q_idx_BxT, q_seg_BxT, k_idx_S, k_seg_BxS):
    return (k_idx_S[None, None, :] <= q_idx_BxT[:, :, None]) & (
        k_seg_BxS[:, None, :] == q_seg_BxT[:, :, None]
    )


def _scores(q_BxTxGxRxE, k_BxSxGxE, mask_BxTxS, scale):
    s = jnp.einsum("btgre,bsge->bgrts", q_BxTxGxRxE, k_BxSxGxE, preferred_element_type=f32) * scale
    return jnp.where(mask_BxTxS[:, None, None], s, MASKED)


def _blocks(q, k, v, q_idx, q_seg, k_idx, k_seg, bq, bk):
    T, S = q.shape[1], k.shape[1]
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    qs = _split(_pad_to(q, Tp, 1, 0), bq, 1)
    q_idx = _split(_pad_to(q_idx, Tp, 1, -1), bq, 1)
    q_seg = _split(_pad_to(q_seg, Tp, 1, 0), bq, 1)
    ks = _split(_pad_to(k, Sp, 1, 0), bk, 1)
    vs = _split(_pad_to(v, Sp, 1, 0), bk, 1)
    k_idx = _split(_pad_to(k_idx, Sp, 0, _FAR), bk, 0)
    k_seg = _split(_pad_to(k_seg, Sp, 1, -1), bk, 1)
    return qs, q_idx, q_seg, ks, vs, k_idx, k_seg


def _forward(q, k, v, q_idx, q_seg, k_idx, k_seg, bq, bk):
    B, T, G, R, E = q.shape
    dt = q.dtype
    scale = E**-0.5
    qs, qi, qsg, ks, vs, ki, ksg = _blocks(q, k, v, q_idx, q_seg, k_idx, k_seg, bq, bk)

    def q_block(args):
        q_b, qi_b, qsg_b = args

        def k_block(carry, kargs):
            k_b, v_b, ki_b, ksg_b = kargs
            mask = _mask(qi_b, qsg_b, ki_b, ksg_b)

            def update(carry):
                m, l, acc = carry
                s = _scores(q_b, k_b, mask, scale)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None])
                corr = jnp.exp(m - m_new)
                pv = jnp.einsum("bgrts,bsge->bgrte", p.astype(dt), v_b, preferred_element_type=f32)
                return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

            return jax.lax.cond(mask.any(), update, lambda c: c, carry), None

        init = (
            jnp.full((B, G, R, bq), MASKED, f32),
            jnp.zeros((B, G, R, bq), f32),
            jnp.zeros((B, G, R, bq, E), f32),
        )
        (m, l, acc), _ = scan_into(k_block, init, (ks, vs, ki, ksg), after=q_b)
        l = jnp.maximum(l, jnp.finfo(f32).tiny)  # a row no visited block covers: output 0
        out = (acc / l[..., None]).transpose(0, 3, 1, 2, 4).astype(dt)  # [B, bq, G, R, E]
        return out, m + jnp.log(l)

    _, (out, lse) = scan_into(lambda c, a: (c, q_block(a)), (), (qs, qi, qsg), after=q)
    return _merge(out, 1)[:, :T], _merge(lse, 3)[..., :T]  # [B, T, G, R, E], [B, G, R, T]


def _backward(q, k, v, q_idx, q_seg, k_idx, k_seg, out, lse, dout, bq, bk):
    B, T, G, R, E = q.shape
    S = k.shape[1]
    dt = q.dtype
    scale = E**-0.5
    qs, qi, qsg, ks, vs, ki, ksg = _blocks(q, k, v, q_idx, q_seg, k_idx, k_seg, bq, bk)
    Tp = qs.shape[0] * bq
    douts = _split(_pad_to(dout.astype(dt), Tp, 1, 0), bq, 1)
    # Per-row sum(dout * out): the softmax-Jacobian term, float32.
    delta = jnp.einsum("btgre,btgre->bgrt", dout.astype(f32), out.astype(f32))
    deltas = _split(_pad_to(delta, Tp, 3, 0), bq, 3)
    lses = _split(_pad_to(lse, Tp, 3, 0), bq, 3)

    def q_block(dkv, args):
        q_b, qi_b, qsg_b, do_b, lse_b, delta_b = args

        def k_block(dq, kargs):
            k_b, v_b, ki_b, ksg_b = kargs
            mask = _mask(qi_b, qsg_b, ki_b, ksg_b)

            def grads(dq):
                p = jnp.exp(_scores(q_b, k_b, mask, scale) - lse_b[..., None])
                dv = jnp.einsum("bgrts,btgre->bsge", p.astype(dt), do_b, preferred_element_type=f32)
                dp = jnp.einsum("btgre,bsge->bgrts", do_b, v_b, preferred_element_type=f32)
                ds = (p * (dp - delta_b[..., None]) * scale).astype(dt)
                dq = dq + jnp.einsum("bgrts,bsge->btgre", ds, k_b, preferred_element_type=f32)
                dk = jnp.einsum("bgrts,btgre->bsge", ds, q_b, preferred_element_type=f32)
                return dq, (dk, dv)

            def skip(dq):
                zeros = jnp.zeros((B, bk, G, E), f32)
                return dq, (zeros, zeros)

            return jax.lax.cond(mask.any(), grads, skip, dq)

        dq, (dk, dv) = scan_into(k_block, jnp.zeros((B, bq, G, R, E), f32), (ks, vs, ki, ksg), after=do_b)
        # A query block's dq is complete here (summed over every key block in float32): stored in q's
        # dtype, the stacked dq is not a float32 copy of all T.
        return (dkv[0] + dk, dkv[1] + dv), dq.astype(q.dtype)

    zeros = zeros_after(ks.shape, f32, dout)  # not a constant every layer's loop copies at once
    (dk, dv), dq = scan_into(q_block, (zeros, zeros), (qs, qi, qsg, douts, lses, deltas), after=dout)
    dq = _merge(dq, 1)[:, :T].astype(q.dtype)
    return dq, _merge(dk, 1)[:, :S].astype(k.dtype), _merge(dv, 1)[:, :S].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def flash_attention(q, k, v, q_idx, q_seg, k_idx, k_seg, q_block=512, k_block=512):
    """Masked softmax attention, scores and softmax statistics in float32; see the module docstring."""
    return _forward(q, k, v, q_idx, q_seg, k_idx, k_seg, q_block, k_block)[0]


def _fwd(q, k, v, q_idx, q_seg, k_idx, k_seg, q_block, k_block):
    out, lse = _forward(q, k, v, q_idx, q_seg, k_idx, k_seg, q_block, k_block)
    return out, (q, k, v, q_idx, q_seg, k_idx, k_seg, out, lse)


def _bwd(q_block, k_block, res, dout):
    q, k, v, q_idx, q_seg, k_idx, k_seg, out, lse = res
    dq, dk, dv = _backward(q, k, v, q_idx, q_seg, k_idx, k_seg, out, lse, dout, q_block, k_block)
    return dq, dk, dv, None, None, None, None


flash_attention.defvjp(_fwd, _bwd)
