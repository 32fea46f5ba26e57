"""Pallas kernels for the chunked gated delta rule, forward and backward, TPU (Mosaic) and GPU (Triton).

Same contract as ``tmax_jax.models.qwen35.delta_rule.chunked_gated_delta_rule`` (its pure-JAX
reference): per batch row ``b`` and value head ``h``, state ``S [K, V]`` in float32,

    S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - k_t^T S))^T ;  o_t = q_t^T S

computed in chunks of ``C`` tokens with the WY/UT transform (``cum`` = cumulative ``g`` in the chunk):

    Gamma[i, j] = exp(cum_i - cum_j) for j <= i in the same packed group, else 0
    A = strictly_lower(diag(beta) K K^T * Gamma),  T = (I + A)^-1
    U = T (beta V),  W = T (beta exp(cum) K),  Vnew = U - W S
    O = (Q exp(cum)) S + (Q K^T * Gamma) Vnew
    S_next = exp(cum_last) S + (K exp(cum_last - cum))^T Vnew

Packing follows the reference: a token whose group differs from the group of the state carried into
its chunk reads a zero state (``cont``), only tokens of the chunk's last group write the carried-out
state (``in_last``), and the carried state survives the chunk only if the whole chunk continues it.

Structure (the template is flash-linear-attention's ``chunk_gated_delta_rule``):
- the forward runs the chunks in order and writes the state entering every chunk
  (``[B, H, N, K, V]`` float32, ``K*V*4/C`` bytes per token and head: 1 KiB at K=V=128, C=64) and
  the final state; these states and the inputs are all the backward keeps;
- the backward runs the chunks in reverse, carrying ``dS``; each chunk's internals (Gamma, A,
  T, W, U, Vnew) are recomputed from the inputs and the stored state, never kept.
- ``T = (I + A)^-1`` by divide and conquer over blocks of 2, 4, ..., C (exact block forward
  substitution, ``2 log2(C)`` plain matmuls, no row loop; see ``_unit_lower_inverse`` for why not
  the Neumann product); its derivative is written out as ``dA = -T^T dT T^T``.
- Value columns are independent in every formula above, so the value dimension is split into blocks
  of ``block_v`` on a parallel grid axis (the chunk's T, W are recomputed per block); the backward's
  dq/dk/dg/dbeta are summed over the blocks afterwards.

Two launchers share the chunk bodies (``_fwd_chunk`` / ``_bwd_chunk`` and their parts):
- TPU (Mosaic): one fused kernel per direction; the chunk index is the innermost grid axis, marked
  ``"arbitrary"`` (sequential), the state lives in VMEM scratch, blocks are ``(C, K)``/``(C, block_v)``.
- GPU (Triton has no sequential grid axis, and one program per (row, head, value block) would leave
  most SMs idle): three kernels per direction, as flash-linear-attention splits it. First the
  chunk-local work that needs no state (the UT transform: W, U; for the backward W and the masked
  Q K^T) for all chunks at once; then only the recurrence (two matmuls per chunk forward, four
  backward), one program per (row, head, value block) looping over the chunks on ``pl.ds`` slices of
  power-of-two shapes; then the chunk-local work that needs the states (outputs; all gradients but
  dS), for all chunks at once. The backward's middle kernel stores the ``dS`` leaving every chunk.

What was tested (``tests/test_kernels_gated_delta_rule.py``): both launchers, forward and backward,
run in Pallas interpret mode on CPU against the pure-JAX path and a float64 NumPy loop; and both
lower (``jax.export`` from the CPU host) through Pallas's Mosaic and Triton lowering rules at the
model's head dims. Neither has been compiled by Mosaic's or Triton's back ends nor run on a chip
from this repository yet: ``benchmarks/device_check.sh`` is the first check to run on one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

f32 = jnp.float32
BACKENDS = ("tpu", "gpu")


# ------------------------------------------------------------------------------------------------
# The chunk body, shared by both launchers. Values only (no refs); every vector is a row [1, C] or a
# column [C, 1]: Triton cannot slice or transpose 1-D register tensors, so columns are made with a
# masked reduction against the identity and cumulative sums with masked reductions against the
# causal mask (Mosaic has no cumsum lowering either).


@dataclasses.dataclass(frozen=True)
class _Dots:
    """The three matmul shapes the bodies use, float32 out, at one precision (``_precision``)."""

    precision: object

    def _dot(self, a, b, dims):
        return lax.dot_general(a, b, (dims, ((), ())), precision=self.precision, preferred_element_type=f32)

    def nn(self, a, b):  # a @ b
        return self._dot(a, b, ((1,), (0,)))

    def nt(self, a, b):  # a @ b.T
        return self._dot(a, b, ((1,), (1,)))

    def tn(self, a, b):  # a.T @ b
        return self._dot(a, b, ((0,), (0,)))


@dataclasses.dataclass
class _Chunk:
    """What one chunk's key side needs, forward and backward alike (independent of V and of S)."""

    causal: jax.Array  # [C, C] bool, j <= i
    strict: jax.Array  # [C, C] bool, j < i
    eye: jax.Array  # [C, C] bool
    gamma: jax.Array  # [C, C] masked decay exp(cum_i - cum_j)
    kk: jax.Array  # [C, C] K K^T
    beta: jax.Array  # [C, 1]
    read: jax.Array  # [C, 1] exp(cum) * cont: how much of the carried state a token reads
    write: jax.Array  # [C, 1] exp(cum_last - cum) * in_last: how much a token writes out
    carry: jax.Array  # [1, 1] exp(cum_last) * chunk_cont: how much of the state survives the chunk
    t_inv: jax.Array  # [C, C] (I + A)^-1
    y: jax.Array  # [C, K] beta * read * K, so that W = T y


def _col(row, eye):
    return jnp.sum(jnp.where(eye, row, 0.0), axis=1, keepdims=True)


def _row(col, eye):
    return jnp.sum(jnp.where(eye, col, 0.0), axis=0, keepdims=True)


def _unit_lower_inverse(d, a_strict, ii, jj):
    """``(I + A)^-1`` for strictly lower ``A [C, C]`` (C a power of two), by divide and conquer.

    With T block-diagonal holding the exact inverses of the blocks of size s/2, every block of size
    s is ``[[T11, 0], [-T22 A21 T11, T22]]``, i.e. ``T - T L T`` with ``L`` the A21 parts of all
    s-blocks at once: log2(C) rounds of two matmuls, each round exact block forward substitution. The
    cheaper-looking product ``(I - A)(I + A^2)(I + A^4)...`` is the same polynomial in exact arithmetic
    but its powers of A grow huge before they cancel: 1e9 relative error at C = 64 on keys sharing a
    direction, where this form stays at 1e-7 like row-by-row substitution.
    """
    C = a_strict.shape[0]
    inv = jnp.where(ii == jj, 1.0, 0.0)
    s = 2
    while s <= C:  # static
        half, shift = s // 2, s.bit_length() - 1
        # Block index and offset by shift and mask (s is a power of two): TPU vector units have no
        # integer division.
        same_block = (ii >> shift) == (jj >> shift)
        lower = same_block & ((ii & half) != 0) & ((jj & half) == 0)
        inv = inv - d.nn(inv, d.nn(jnp.where(lower, a_strict, 0.0), inv))
        s *= 2
    return inv


def _iotas(C):
    return lax.broadcasted_iota(jnp.int32, (C, C), 0), lax.broadcasted_iota(jnp.int32, (C, C), 1)


def _gates(rows, C):
    """The chunk's decays and masks: ``(causal, strict, eye, gamma, beta, read, write, carry)``."""
    g_row, beta_row, grp_row, cont_row, inlast_row, cc_row = rows
    ii, jj = _iotas(C)
    causal, strict, eye = ii >= jj, ii > jj, ii == jj
    cum_col = jnp.sum(jnp.where(causal, g_row, 0.0), axis=1, keepdims=True)  # [C, 1]: sum_{j<=i} g_j
    cum_row = jnp.sum(jnp.where(ii <= jj, _col(g_row, eye), 0.0), axis=0, keepdims=True)
    cum_last = jnp.sum(g_row, axis=1, keepdims=True)  # [1, 1]
    same = causal & (_col(grp_row, eye) == grp_row)
    # exp only where the difference is <= 0 in exact arithmetic: the masked-out upper part may overflow.
    gamma = jnp.where(same, jnp.exp(jnp.where(same, cum_col - cum_row, 0.0)), 0.0)
    beta = _col(beta_row, eye)
    read = jnp.exp(cum_col) * _col(cont_row, eye)
    write = jnp.exp(cum_last - cum_col) * _col(inlast_row, eye)
    carry = jnp.exp(cum_last) * jnp.max(cc_row, axis=1, keepdims=True)
    return causal, strict, eye, gamma, beta, read, write, carry


def _chunk(d, k, rows) -> _Chunk:
    causal, strict, eye, gamma, beta, read, write, carry = _gates(rows, k.shape[0])
    kk = d.nt(k, k)
    a_strict = jnp.where(strict, beta * kk * gamma, 0.0)
    t_inv = _unit_lower_inverse(d, a_strict, *_iotas(k.shape[0]))
    return _Chunk(causal, strict, eye, gamma, kk, beta, read, write, carry, t_inv, k * (beta * read))


def _fwd_chunk(d, q, k, v, rows, s):
    """One chunk forward: ``(o [C, BV], s_next [K, BV])`` from the state ``s`` carried into it."""
    c = _chunk(d, k, rows)
    u = d.nn(c.t_inv, v * c.beta)
    v_new = u - d.nn(d.nn(c.t_inv, c.y), s)
    intra = jnp.where(c.causal, d.nt(q, k) * c.gamma, 0.0)
    o = d.nn(q * c.read, s) + d.nn(intra, v_new)
    s_next = c.carry * s + d.tn(k * c.write, v_new)
    return o, s_next


def _bwd_chunk(d, q, k, v, rows, s, do, ds_next):
    """One chunk backward: cotangents of (q, k, v, g, beta) and of the carried-in state."""
    c = _chunk(d, k, rows)
    # Recompute the forward's chunk internals.
    x = v * c.beta
    w = d.nn(c.t_inv, c.y)
    v_new = d.nn(c.t_inv, x) - d.nn(w, s)
    qk = d.nt(q, k)
    intra = jnp.where(c.causal, qk * c.gamma, 0.0)
    q_read, k_write = q * c.read, k * c.write

    # o = q_read s + intra v_new ;  s_next = carry s + k_write^T v_new
    dv_new = d.tn(intra, do) + d.nn(k_write, ds_next)
    ds = d.tn(q_read, do) + c.carry * ds_next - d.tn(w, dv_new)
    dq_read = d.nt(do, s)
    d_intra = d.nt(do, v_new)
    dk_write = d.nt(v_new, ds_next)
    d_carry = jnp.sum(jnp.sum(s * ds_next, axis=1, keepdims=True), axis=0, keepdims=True)

    # v_new = T x - T y s  ->  dT = dv_new x^T + dW y^T with dW = -dv_new s^T
    dw = -d.nt(dv_new, s)
    dt = d.nt(dv_new, x) + d.nt(dw, c.y)
    dx = d.tn(c.t_inv, dv_new)
    dy = d.tn(c.t_inv, dw)
    dv = dx * c.beta
    dk = dy * (c.beta * c.read)
    y_k = jnp.sum(dy * k, axis=1, keepdims=True)
    dbeta = jnp.sum(dx * v, axis=1, keepdims=True) + y_k * c.read
    dread = y_k * c.beta

    # T = (I + A)^-1  ->  dA = -T^T dT T^T, only its strictly lower part feeds A.
    da = jnp.where(c.strict, -d.tn(c.t_inv, d.nt(dt, c.t_inv)), 0.0)
    dkk = da * c.beta * c.gamma
    dk = dk + d.nn(dkk, k) + d.tn(dkk, k)
    dbeta = dbeta + jnp.sum(da * c.kk * c.gamma, axis=1, keepdims=True)
    dgamma = da * c.beta * c.kk

    dqk = jnp.where(c.causal, d_intra * c.gamma, 0.0)
    dq = d.nn(dqk, k) + dq_read * c.read
    dk = dk + d.tn(dqk, q) + dk_write * c.write
    dgamma = dgamma + jnp.where(c.causal, d_intra * qk, 0.0)
    dread = dread + jnp.sum(dq_read * q, axis=1, keepdims=True)
    dwrite = jnp.sum(dk_write * k, axis=1, keepdims=True)

    # Back to cum: read_i ~ exp(cum_i), write_i ~ exp(cum_last - cum_i), gamma_ij ~ exp(cum_i - cum_j),
    # carry ~ exp(cum_last); then g_t = sum over i >= t of dcum_i (cum is a prefix sum, cum_last = sum g).
    e = dgamma * c.gamma
    dcum_col = dread * c.read - dwrite * c.write + jnp.sum(e, axis=1, keepdims=True)
    dcum_from_cols = _col(jnp.sum(e, axis=0, keepdims=True), c.eye)  # the -cum_j side of gamma
    dcum_col = dcum_col - dcum_from_cols
    dcum_last = jnp.sum(dwrite * c.write, axis=0, keepdims=True) + d_carry * c.carry  # [1, 1]
    dg_row = jnp.sum(jnp.where(c.causal, dcum_col, 0.0), axis=0, keepdims=True) + dcum_last
    return dq, dk, dv, dg_row, _row(dbeta, c.eye), ds


def _prep_fwd(d, k, v, rows):
    """The chunk's ``W`` and ``U`` (GPU: computed for every chunk at once, before the recurrence)."""
    c = _chunk(d, k, rows)
    return d.nn(c.t_inv, c.y), d.nn(c.t_inv, v * c.beta)


def _prep_bwd(d, q, k, rows):
    """The chunk's ``W`` and its masked intra-chunk scores ``Q K^T * Gamma``."""
    c = _chunk(d, k, rows)
    return d.nn(c.t_inv, c.y), jnp.where(c.causal, d.nt(q, k) * c.gamma, 0.0)


def _state_step(d, w, u, k, rows, s):
    """The forward recurrence alone: the state after the chunk, from its ``W`` and ``U``."""
    *_, write, carry = _gates(rows, k.shape[0])
    return carry * s + d.tn(k * write, u - d.nn(w, s))


def _out_chunk(d, q, k, w, u, rows, s):
    """The chunk's output from the state carried into it and its ``W``, ``U``."""
    causal, _, _, gamma, _, read, _, _ = _gates(rows, k.shape[0])
    intra = jnp.where(causal, d.nt(q, k) * gamma, 0.0)
    return d.nn(q * read, s) + d.nn(intra, u - d.nn(w, s))


def _dstate_step(d, w, intra, q, k, rows, do, ds_next):
    """The backward recurrence alone: ``dS`` carried into the chunk from the one carried out of it."""
    _, _, _, _, _, read, write, carry = _gates(rows, k.shape[0])
    dv_new = d.tn(intra, do) + d.nn(k * write, ds_next)
    return d.tn(q * read, do) + carry * ds_next - d.tn(w, dv_new)


# ------------------------------------------------------------------------------------------------
# Launchers. Layouts (prepared by ``_prepare``): q, k [B, H, Tp, K]; v [B, H, Tp, V] in the caller's
# dtype; gb [B, H, N, 2, C] f32 (rows g, beta); meta [B, N, 4, C] f32 (rows: group id relative to the
# chunk's first token, cont, in_last, chunk_cont).


def _rows(gb_ref, meta_ref, idx=()):
    def row(ref, i):
        return ref[(*idx, pl.ds(i, 1), slice(None))].astype(f32)

    return (row(gb_ref, 0), row(gb_ref, 1), *(row(meta_ref, i) for i in range(4)))


PRECISIONS = ("highest", "high")


@dataclasses.dataclass(frozen=True)
class Launch:
    """Static launch choices: ``backend`` picks the launcher (``tpu``/``gpu``), ``interpret`` runs it in
    Pallas interpret mode (any host, slow: for tests; ``pallas_call``'s own values, e.g. the TPU
    interpreter's ``pltpu.InterpretParams``, pass through), ``block_v`` splits the value dimension,
    ``precision`` sets the kernels' float32 matmuls (``_precision``)."""

    chunk_size: int
    block_v: int
    backend: str
    interpret: object
    precision: str = "highest"


def _precision(launch: Launch):
    """``highest``: full float32 products (TPU: Mosaic's fp32 contraction; GPU: Triton's IEEE fp32, which
    uses no tensor cores). ``high``: on GPU, TF32x3 on tensor cores (~float32 from three passes), for
    speed; Mosaic offers nothing between bf16 and fp32, so on TPU it is ``highest``. Interpret mode
    (CPU) is exact float32 either way: ``high`` is checked there for its plumbing, not its numerics."""
    if launch.precision == "high" and launch.backend == "gpu" and launch.interpret is False:
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.Precision.HIGHEST


def _compiler_params(launch: Launch, n_grid: int, sequential_last: bool):
    if launch.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        sem = ("parallel",) * (n_grid - 1) + ("arbitrary" if sequential_last else "parallel",)
        return pltpu.CompilerParams(dimension_semantics=sem)
    from jax.experimental.pallas import triton as pltr

    return pltr.CompilerParams(num_warps=4 if launch.block_v <= 64 else 8, num_stages=1)


def _vmem(shape):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.VMEM(shape, f32)


def _forward_call(launch: Launch, q, k, v, gb, meta, s0):
    d = _Dots(_precision(launch))
    B, H, Tp, K = q.shape
    V = v.shape[-1]
    C, BV = launch.chunk_size, launch.block_v
    N, NV = Tp // C, V // BV
    out_shape = (
        jax.ShapeDtypeStruct((B, H, Tp, V), f32),
        jax.ShapeDtypeStruct((B, H, N, K, V), f32),
        jax.ShapeDtypeStruct((B, H, K, V), f32),
    )
    if launch.backend == "tpu":

        def kernel(q_ref, k_ref, v_ref, gb_ref, meta_ref, s0_ref, o_ref, states_ref, sfin_ref, s_scr):
            n = pl.program_id(3)

            @pl.when(n == 0)
            def _():
                s_scr[...] = s0_ref[...].astype(f32)

            s = s_scr[...]
            states_ref[...] = s
            o, s_next = _fwd_chunk(
                d,
                q_ref[...].astype(f32),
                k_ref[...].astype(f32),
                v_ref[...].astype(f32),
                _rows(gb_ref, meta_ref),
                s,
            )
            o_ref[...] = o
            s_scr[...] = s_next

            @pl.when(n == pl.num_programs(3) - 1)
            def _():
                sfin_ref[...] = s_next

        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=(B, H, NV, N),
            in_specs=[
                pl.BlockSpec((None, None, C, K), lambda b, h, j, n: (b, h, n, 0)),
                pl.BlockSpec((None, None, C, K), lambda b, h, j, n: (b, h, n, 0)),
                pl.BlockSpec((None, None, C, BV), lambda b, h, j, n: (b, h, n, j)),
                pl.BlockSpec((None, None, None, 2, C), lambda b, h, j, n: (b, h, n, 0, 0)),
                pl.BlockSpec((None, None, 4, C), lambda b, h, j, n: (b, n, 0, 0)),
                pl.BlockSpec((None, None, K, BV), lambda b, h, j, n: (b, h, 0, j)),
            ],
            out_specs=[
                pl.BlockSpec((None, None, C, BV), lambda b, h, j, n: (b, h, n, j)),
                pl.BlockSpec((None, None, None, K, BV), lambda b, h, j, n: (b, h, n, 0, j)),
                pl.BlockSpec((None, None, K, BV), lambda b, h, j, n: (b, h, 0, j)),
            ],
            scratch_shapes=[_vmem((K, BV))],
            compiler_params=_compiler_params(launch, 4, True),
            interpret=launch.interpret,
            name="gated_delta_rule_fwd",
        )(q, k, v, gb, meta, s0)

    return _forward_gpu(launch, q, k, v, gb, meta, s0)


def _backward_call(launch: Launch, q, k, v, gb, meta, states, do, ds_final):
    d = _Dots(_precision(launch))
    B, H, Tp, K = q.shape
    V = v.shape[-1]
    C, BV = launch.chunk_size, launch.block_v
    N, NV = Tp // C, V // BV
    out_shape = (
        jax.ShapeDtypeStruct((NV, B, H, Tp, K), f32),  # dq, partial sums over value blocks
        jax.ShapeDtypeStruct((NV, B, H, Tp, K), f32),  # dk, partial
        jax.ShapeDtypeStruct((B, H, Tp, V), f32),  # dv
        jax.ShapeDtypeStruct((NV, B, H, N, 2, C), f32),  # dg, dbeta, partial
        jax.ShapeDtypeStruct((B, H, K, V), f32),  # d initial state
    )

    def store_rows(dgb_ref, dg, dbeta, idx=()):
        dgb_ref[(*idx, pl.ds(0, 1), slice(None))] = dg
        dgb_ref[(*idx, pl.ds(1, 1), slice(None))] = dbeta

    if launch.backend == "tpu":

        def kernel(
            q_ref, k_ref, v_ref, gb_ref, meta_ref, st_ref, do_ref, dsf_ref,
            dq_ref, dk_ref, dv_ref, dgb_ref, ds0_ref, ds_scr,
        ):  # fmt: skip
            n = pl.program_id(3)  # chunk N-1-n: the index maps run the chunks in reverse

            @pl.when(n == 0)
            def _():
                ds_scr[...] = dsf_ref[...].astype(f32)

            dq, dk, dv, dg, dbeta, ds = _bwd_chunk(
                d,
                q_ref[...].astype(f32),
                k_ref[...].astype(f32),
                v_ref[...].astype(f32),
                _rows(gb_ref, meta_ref),
                st_ref[...],
                do_ref[...].astype(f32),
                ds_scr[...],
            )
            dq_ref[...], dk_ref[...], dv_ref[...] = dq, dk, dv
            store_rows(dgb_ref, dg, dbeta)
            ds_scr[...] = ds

            @pl.when(n == pl.num_programs(3) - 1)
            def _():
                ds0_ref[...] = ds

        rev = N - 1
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=(B, H, NV, N),
            in_specs=[
                pl.BlockSpec((None, None, C, K), lambda b, h, j, n: (b, h, rev - n, 0)),
                pl.BlockSpec((None, None, C, K), lambda b, h, j, n: (b, h, rev - n, 0)),
                pl.BlockSpec((None, None, C, BV), lambda b, h, j, n: (b, h, rev - n, j)),
                pl.BlockSpec((None, None, None, 2, C), lambda b, h, j, n: (b, h, rev - n, 0, 0)),
                pl.BlockSpec((None, None, 4, C), lambda b, h, j, n: (b, rev - n, 0, 0)),
                pl.BlockSpec((None, None, None, K, BV), lambda b, h, j, n: (b, h, rev - n, 0, j)),
                pl.BlockSpec((None, None, C, BV), lambda b, h, j, n: (b, h, rev - n, j)),
                pl.BlockSpec((None, None, K, BV), lambda b, h, j, n: (b, h, 0, j)),
            ],
            out_specs=[
                pl.BlockSpec((None, None, None, C, K), lambda b, h, j, n: (j, b, h, rev - n, 0)),
                pl.BlockSpec((None, None, None, C, K), lambda b, h, j, n: (j, b, h, rev - n, 0)),
                pl.BlockSpec((None, None, C, BV), lambda b, h, j, n: (b, h, rev - n, j)),
                pl.BlockSpec((None, None, None, None, 2, C), lambda b, h, j, n: (j, b, h, rev - n, 0, 0)),
                pl.BlockSpec((None, None, K, BV), lambda b, h, j, n: (b, h, 0, j)),
            ],
            scratch_shapes=[_vmem((K, BV))],
            compiler_params=_compiler_params(launch, 4, True),
            interpret=launch.interpret,
            name="gated_delta_rule_bwd",
        )(q, k, v, gb, meta, states, do, ds_final)

    return _backward_gpu(launch, q, k, v, gb, meta, states, do, ds_final, out_shape, store_rows)


# GPU: Triton has no sequential grid axis, and one program per (row, head, value block) alone would
# leave most of the chip idle. So each direction is three kernels, as flash-linear-attention splits
# it: the chunk-local work that needs no state (the UT transform) for all chunks at once; then only
# the recurrence, one program per (row, head, value block) looping over the chunks; then the
# chunk-local work that needs the states, for all chunks at once again.


def _gpu_call(launch, kernel, grid, in_specs, out_specs, out_shape, name):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=_compiler_params(launch, len(grid), False),
        interpret=launch.interpret,
        name=name,
    )


def _forward_gpu(launch: Launch, q, k, v, gb, meta, s0):
    d = _Dots(_precision(launch))
    B, H, Tp, K = q.shape
    V = v.shape[-1]
    C, BV = launch.chunk_size, launch.block_v
    N, NV = Tp // C, V // BV
    by_chunk_k = pl.BlockSpec((None, None, C, K), lambda b, h, n: (b, h, n, 0))
    gb_chunk = pl.BlockSpec((None, None, None, 2, C), lambda b, h, n: (b, h, n, 0, 0))
    meta_chunk = pl.BlockSpec((None, None, 4, C), lambda b, h, n: (b, n, 0, 0))

    def prep(k_ref, v_ref, gb_ref, meta_ref, w_ref, u_ref):
        w_ref[...], u_ref[...] = _prep_fwd(
            d, k_ref[...].astype(f32), v_ref[...].astype(f32), _rows(gb_ref, meta_ref)
        )

    w, u = _gpu_call(
        launch,
        prep,
        (B, H, N),
        [by_chunk_k, pl.BlockSpec((None, None, C, V), lambda b, h, n: (b, h, n, 0)), gb_chunk, meta_chunk],
        [by_chunk_k, pl.BlockSpec((None, None, C, V), lambda b, h, n: (b, h, n, 0))],
        (jax.ShapeDtypeStruct((B, H, Tp, K), f32), jax.ShapeDtypeStruct((B, H, Tp, V), f32)),
        "gated_delta_rule_fwd_prep",
    )(k, v, gb, meta)

    def recurrence(w_ref, u_ref, k_ref, gb_ref, meta_ref, s0_ref, states_ref, sfin_ref):
        def step(n, s):
            t = pl.ds(pl.multiple_of(n * C, C), C)
            states_ref[n] = s
            return _state_step(
                d, w_ref[t, :], u_ref[t, :], k_ref[t, :].astype(f32), _rows(gb_ref, meta_ref, (n,)), s
            )

        sfin_ref[...] = lax.fori_loop(0, N, step, s0_ref[...].astype(f32))

    whole_k = pl.BlockSpec((None, None, Tp, K), lambda b, h, j: (b, h, 0, 0))
    state_block = pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j))
    states, s_final = _gpu_call(
        launch,
        recurrence,
        (B, H, NV),
        [
            whole_k,
            pl.BlockSpec((None, None, Tp, BV), lambda b, h, j: (b, h, 0, j)),
            whole_k,
            pl.BlockSpec((None, None, N, 2, C), lambda b, h, j: (b, h, 0, 0, 0)),
            pl.BlockSpec((None, N, 4, C), lambda b, h, j: (b, 0, 0, 0)),
            state_block,
        ],
        [pl.BlockSpec((None, None, N, K, BV), lambda b, h, j: (b, h, 0, 0, j)), state_block],
        (jax.ShapeDtypeStruct((B, H, N, K, V), f32), jax.ShapeDtypeStruct((B, H, K, V), f32)),
        "gated_delta_rule_fwd_states",
    )(w, u, k, gb, meta, s0)

    def out(q_ref, k_ref, w_ref, u_ref, gb_ref, meta_ref, st_ref, o_ref):
        o_ref[...] = _out_chunk(
            d,
            q_ref[...].astype(f32),
            k_ref[...].astype(f32),
            w_ref[...],
            u_ref[...],
            _rows(gb_ref, meta_ref),
            st_ref[...],
        )

    chunk_k = pl.BlockSpec((None, None, C, K), lambda b, h, j, n: (b, h, n, 0))
    chunk_v = pl.BlockSpec((None, None, C, BV), lambda b, h, j, n: (b, h, n, j))
    o = _gpu_call(
        launch,
        out,
        (B, H, NV, N),
        [
            chunk_k,
            chunk_k,
            chunk_k,
            chunk_v,
            pl.BlockSpec((None, None, None, 2, C), lambda b, h, j, n: (b, h, n, 0, 0)),
            pl.BlockSpec((None, None, 4, C), lambda b, h, j, n: (b, n, 0, 0)),
            pl.BlockSpec((None, None, None, K, BV), lambda b, h, j, n: (b, h, n, 0, j)),
        ],
        chunk_v,
        jax.ShapeDtypeStruct((B, H, Tp, V), f32),
        "gated_delta_rule_fwd_out",
    )(q, k, w, u, gb, meta, states)
    return o, states, s_final


def _backward_gpu(launch: Launch, q, k, v, gb, meta, states, do, ds_final, out_shape, store_rows):
    d = _Dots(_precision(launch))
    B, H, Tp, K = q.shape
    V = v.shape[-1]
    C, BV = launch.chunk_size, launch.block_v
    N, NV = Tp // C, V // BV
    by_chunk_k = pl.BlockSpec((None, None, C, K), lambda b, h, n: (b, h, n, 0))
    by_chunk_cc = pl.BlockSpec((None, None, None, C, C), lambda b, h, n: (b, h, n, 0, 0))

    def prep(q_ref, k_ref, gb_ref, meta_ref, w_ref, intra_ref):
        w_ref[...], intra_ref[...] = _prep_bwd(
            d, q_ref[...].astype(f32), k_ref[...].astype(f32), _rows(gb_ref, meta_ref)
        )

    w, intra = _gpu_call(
        launch,
        prep,
        (B, H, N),
        [
            by_chunk_k,
            by_chunk_k,
            pl.BlockSpec((None, None, None, 2, C), lambda b, h, n: (b, h, n, 0, 0)),
            pl.BlockSpec((None, None, 4, C), lambda b, h, n: (b, n, 0, 0)),
        ],
        [by_chunk_k, by_chunk_cc],
        (jax.ShapeDtypeStruct((B, H, Tp, K), f32), jax.ShapeDtypeStruct((B, H, N, C, C), f32)),
        "gated_delta_rule_bwd_prep",
    )(q, k, gb, meta)

    def recurrence(w_ref, intra_ref, q_ref, k_ref, gb_ref, meta_ref, do_ref, dsf_ref, dsn_ref, ds0_ref):
        def step(i, ds_next):
            n = N - 1 - i
            t = pl.ds(pl.multiple_of(n * C, C), C)
            dsn_ref[n] = ds_next
            return _dstate_step(
                d,
                w_ref[t, :],
                intra_ref[n],
                q_ref[t, :].astype(f32),
                k_ref[t, :].astype(f32),
                _rows(gb_ref, meta_ref, (n,)),
                do_ref[t, :].astype(f32),
                ds_next,
            )

        ds0_ref[...] = lax.fori_loop(0, N, step, dsf_ref[...].astype(f32))

    whole_k = pl.BlockSpec((None, None, Tp, K), lambda b, h, j: (b, h, 0, 0))
    state_block = pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j))
    ds_next, ds0 = _gpu_call(
        launch,
        recurrence,
        (B, H, NV),
        [
            whole_k,
            pl.BlockSpec((None, None, N, C, C), lambda b, h, j: (b, h, 0, 0, 0)),
            whole_k,
            whole_k,
            pl.BlockSpec((None, None, N, 2, C), lambda b, h, j: (b, h, 0, 0, 0)),
            pl.BlockSpec((None, N, 4, C), lambda b, h, j: (b, 0, 0, 0)),
            pl.BlockSpec((None, None, Tp, BV), lambda b, h, j: (b, h, 0, j)),
            state_block,
        ],
        [pl.BlockSpec((None, None, N, K, BV), lambda b, h, j: (b, h, 0, 0, j)), state_block],
        (jax.ShapeDtypeStruct((B, H, N, K, V), f32), jax.ShapeDtypeStruct((B, H, K, V), f32)),
        "gated_delta_rule_bwd_states",
    )(w, intra, q, k, gb, meta, do, ds_final)

    def grads(
        q_ref, k_ref, v_ref, gb_ref, meta_ref, st_ref, do_ref, dsn_ref, dq_ref, dk_ref, dv_ref, dgb_ref
    ):
        dq, dk, dv, dg, dbeta, _ = _bwd_chunk(
            d,
            q_ref[...].astype(f32),
            k_ref[...].astype(f32),
            v_ref[...].astype(f32),
            _rows(gb_ref, meta_ref),
            st_ref[...],
            do_ref[...].astype(f32),
            dsn_ref[...],
        )
        dq_ref[...], dk_ref[...], dv_ref[...] = dq, dk, dv
        store_rows(dgb_ref, dg, dbeta)

    chunk_k = pl.BlockSpec((None, None, C, K), lambda b, h, j, n: (b, h, n, 0))
    chunk_v = pl.BlockSpec((None, None, C, BV), lambda b, h, j, n: (b, h, n, j))
    chunk_state = pl.BlockSpec((None, None, None, K, BV), lambda b, h, j, n: (b, h, n, 0, j))
    partial_k = pl.BlockSpec((None, None, None, C, K), lambda b, h, j, n: (j, b, h, n, 0))
    dq, dk, dv, dgb = _gpu_call(
        launch,
        grads,
        (B, H, NV, N),
        [
            chunk_k,
            chunk_k,
            chunk_v,
            pl.BlockSpec((None, None, None, 2, C), lambda b, h, j, n: (b, h, n, 0, 0)),
            pl.BlockSpec((None, None, 4, C), lambda b, h, j, n: (b, n, 0, 0)),
            chunk_state,
            chunk_v,
            chunk_state,
        ],
        [
            partial_k,
            partial_k,
            chunk_v,
            pl.BlockSpec((None, None, None, None, 2, C), lambda b, h, j, n: (j, b, h, n, 0, 0)),
        ],
        out_shape[:4],
        "gated_delta_rule_bwd_grads",
    )(q, k, v, gb, meta, states, do, ds_next)
    return dq, dk, dv, dgb, ds0


# ------------------------------------------------------------------------------------------------
# Layout plumbing (plain JAX around the kernels) and the custom VJP.


def _heads_first(x, pad):
    """[B, T, H, D] -> [B, H, T + pad, D], zero-padded along T."""
    return jnp.swapaxes(jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))), 1, 2)


def _prepare(launch: Launch, q, k, v, g, beta, groups):
    B, T, H, _ = q.shape
    C = launch.chunk_size
    pad = (-T) % C
    N = (T + pad) // C
    # Pads: zero key, g = beta = 0, the last token's group: they neither decay nor write the state.
    gb = jnp.pad(jnp.stack([g, beta], axis=-1), ((0, 0), (0, pad), (0, 0), (0, 0)))  # [B, Tp, H, 2]
    gb = jnp.transpose(gb.reshape(B, N, C, H, 2), (0, 3, 1, 4, 2))  # [B, H, N, 2, C]
    grp = jnp.pad(groups.astype(jnp.int32), ((0, 0), (0, pad)), mode="edge").reshape(B, N, C)
    prev_last = jnp.concatenate([jnp.zeros_like(grp[:, :1, -1]), grp[:, :-1, -1]], axis=1)  # [B, N]
    last = grp[:, :, -1]
    meta = jnp.stack(
        [
            # Relative ids stay small, so they are exact in float32 whatever the absolute counts.
            (grp - grp[:, :, :1]).astype(f32),
            (grp == prev_last[..., None]).astype(f32),
            (grp == last[..., None]).astype(f32),
            jnp.broadcast_to((last == prev_last)[..., None], grp.shape).astype(f32),
        ],
        axis=2,
    )  # [B, N, 4, C]
    return _heads_first(q, pad), _heads_first(k, pad), _heads_first(v, pad), gb, meta


def _forward(launch: Launch, q, k, v, g, beta, s0, groups):
    T = q.shape[1]
    qh, kh, vh, gb, meta = _prepare(launch, q, k, v, g, beta, groups)
    o, states, s_final = _forward_call(launch, qh, kh, vh, gb, meta, s0)
    return jnp.swapaxes(o, 1, 2)[:, :T], s_final, states


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _gdr(q, k, v, g, beta, s0, groups, launch):
    o, s_final, _ = _forward(launch, q, k, v, g, beta, s0, groups)
    return o, s_final


def _gdr_fwd(q, k, v, g, beta, s0, groups, launch):
    o, s_final, states = _forward(launch, q, k, v, g, beta, s0, groups)
    # Residuals: the inputs and one float32 state per chunk; the chunk internals are recomputed.
    return (o, s_final), (q, k, v, g, beta, groups, states)


def _gdr_bwd(launch, res, cts):
    q, k, v, g, beta, groups, states = res
    do, ds_final = cts
    B, T, H, _ = q.shape
    C = launch.chunk_size
    pad = (-T) % C
    N = (T + pad) // C
    qh, kh, vh, gb, meta = _prepare(launch, q, k, v, g, beta, groups)
    doh = _heads_first(do.astype(f32), pad)
    dq, dk, dv, dgb, ds0 = _backward_call(launch, qh, kh, vh, gb, meta, states, doh, ds_final.astype(f32))

    def tokens_first(x):
        return jnp.swapaxes(x, 1, 2)[:, :T]

    dgb = jnp.transpose(dgb.sum(0), (0, 2, 4, 1, 3)).reshape(B, N * C, H, 2)[:, :T]
    return (
        tokens_first(dq.sum(0)).astype(q.dtype),
        tokens_first(dk.sum(0)).astype(k.dtype),
        tokens_first(dv).astype(v.dtype),
        dgb[..., 0],
        dgb[..., 1],
        ds0,
        None,
    )


_gdr.defvjp(_gdr_fwd, _gdr_bwd)


def _check(q, k, v, g, beta, s0, groups, chunk_size, block_v, backend):
    # Shapes and dtypes as the pure-JAX path checks them (one contract), then the kernels' own limits.
    # Imported here: the model package imports this module (through its config).
    from tmax_jax.models.qwen35.delta_rule import check_shapes

    check_shapes(q, k, v, g, beta, s0, groups, chunk_size)
    K, V = k.shape[-1], v.shape[-1]
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {list(BACKENDS)}")
    if chunk_size < 8 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size={chunk_size} must be a power of two >= 8 for the Pallas kernels")
    if V % block_v:
        raise ValueError(f"block_v={block_v} must divide the value head dim {V}")
    if backend == "tpu" and block_v != V and block_v % 128:
        raise ValueError(f"block_v={block_v} on TPU must equal the value dim {V} or be a multiple of 128")
    if backend == "gpu":
        # Triton tensors are power-of-two sized and tl.dot wants every dimension >= 16.
        for name, n in (("chunk_size", chunk_size), ("key dim", K), ("value dim", V), ("block_v", block_v)):
            if n < 16 or n & (n - 1):
                raise ValueError(f"{name}={n} must be a power of two >= 16 for the GPU (Triton) kernel")


def default_block_v(value_dim: int, backend: str) -> int:
    """TPU: the whole value dim (MXU-wide lanes). GPU: 64 columns, to keep the per-program state
    ``[K, 64]`` float32 within registers and give the grid more programs."""
    if backend == "gpu" and value_dim > 64 and value_dim % 64 == 0:
        return 64
    return value_dim


def pallas_chunked_gated_delta_rule(
    q_BxTxHxK: jax.Array,
    k_BxTxHxK: jax.Array,
    v_BxTxHxV: jax.Array,
    g_BxTxH: jax.Array,
    beta_BxTxH: jax.Array,
    initial_state_BxHxKxV: jax.Array | None = None,
    groups_BxT: jax.Array | None = None,
    chunk_size: int = 64,
    *,
    backend: str = "tpu",
    interpret: bool = False,
    block_v: int | None = None,
    precision: str = "highest",
) -> tuple[jax.Array, jax.Array]:
    """Returns ``(out [B, T, H, V] float32, final_state [B, H, K, V] float32)``, differentiable in
    q, k, v, g, beta and the initial state (a ``jax.custom_vjp`` over the two kernels).

    ``backend`` picks the launcher ("tpu": Mosaic, "gpu": Triton); ``interpret=True`` runs either in
    Pallas interpret mode on any host. ``precision``: "highest" (default, full float32 matmuls, as the
    JAX path) or "high" (GPU: TF32x3, faster; see ``_precision``). The initial state belongs to group
    0, as in the JAX path.
    """
    B, T, H, K = k_BxTxHxK.shape
    V = v_BxTxHxV.shape[-1]
    bv = default_block_v(V, backend) if block_v is None else block_v
    _check(
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH,
        initial_state_BxHxKxV, groups_BxT, chunk_size, bv, backend,
    )  # fmt: skip
    s0 = jnp.zeros((B, H, K, V), f32) if initial_state_BxHxKxV is None else initial_state_BxHxKxV.astype(f32)
    groups = jnp.zeros((B, T), jnp.int32) if groups_BxT is None else groups_BxT.astype(jnp.int32)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; expected one of {list(PRECISIONS)}")
    launch = Launch(
        chunk_size=chunk_size, block_v=bv, backend=backend, interpret=interpret, precision=precision
    )
    # g and beta are tiny next to q/k/v: float32 from the start (they enter exponentials and gates).
    return _gdr(
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH.astype(f32), beta_BxTxH.astype(f32), s0, groups, launch
    )
