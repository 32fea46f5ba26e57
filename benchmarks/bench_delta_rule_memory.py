"""Temporaries of training through the chunked gated delta rule, from XLA's compiled memory analysis.

``jax.jit(jax.value_and_grad(loss)).lower(...).compile().memory_analysis().temp_size_in_bytes`` for a
loss through ``chunked_gated_delta_rule`` (B=1, 4 heads, dk = dv = 128, bfloat16 inputs, gradients
for q, k, v, g, beta), printed as bytes per token per head for T = 2K..16K. The implementation before
the custom VJP (autodiff through a forward-substitution loop) is kept below as ``_old_chunked`` and
measured in the same run for the ratio. Compiling only, nothing runs: quick even at T = 16K.

    python benchmarks/bench_delta_rule_memory.py
    python benchmarks/bench_delta_rule_memory.py --seqs 2048,16384 --no-old
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from tmax_jax.models.qwen35.delta_rule import chunked_gated_delta_rule

f32 = jnp.float32


def _old_mm(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=f32)


def _old_unit_lower_inverse(strict_lower):
    C = strict_lower.shape[-1]
    eye = jnp.eye(C, dtype=strict_lower.dtype)

    def row(i, inv):
        r = eye[i] - _old_mm(
            "...j,...jk->...k", jax.lax.dynamic_index_in_dim(strict_lower, i, -2, False), inv
        )
        return jax.lax.dynamic_update_index_in_dim(inv, r, i, -2)

    return jax.lax.fori_loop(0, C, row, jnp.broadcast_to(eye, strict_lower.shape))


def _old_chunked(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, chunk_size=64):
    """The chunked delta rule as it was before its custom VJP (no groups, zero initial state)."""
    B, T, H, K = k_BxTxHxK.shape
    V = v_BxTxHxV.shape[-1]
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C

    def to_chunks(x):
        x = jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1) if x.ndim > 3 else x

    q, k, v = to_chunks(q_BxTxHxK), to_chunks(k_BxTxHxK), to_chunks(v_BxTxHxV)
    g, beta = to_chunks(g_BxTxH), to_chunks(beta_BxTxH)
    cum = jnp.cumsum(g, axis=-1)
    causal = jnp.tril(jnp.ones((C, C), bool))
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    t_inv = _old_unit_lower_inverse(jnp.where(strict, _old_mm("bhnck,bhnsk->bhncs", k_beta, k) * decay, 0.0))
    u = _old_mm("bhncs,bhnsv->bhncv", t_inv, v_beta)
    w = _old_mm("bhncs,bhnsk->bhnck", t_inv, k_beta * jnp.exp(cum)[..., None])
    intra = _old_mm("bhnck,bhnsk->bhncs", q, k) * decay
    q_read = q * jnp.exp(cum)[..., None]
    k_write = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    state_decay = jnp.exp(cum[..., -1])

    def step(s, xs):
        u_n, w_n, q_n, k_n, intra_n, decay_n = xs
        v_new = u_n - _old_mm("bhck,bhkv->bhcv", w_n, s)
        o_n = _old_mm("bhck,bhkv->bhcv", q_n, s) + _old_mm("bhcs,bhsv->bhcv", intra_n, v_new)
        return s * decay_n[..., None, None] + _old_mm("bhck,bhcv->bhkv", k_n, v_new), o_n

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_read, k_write, intra, state_decay))
    s_final, o = jax.lax.scan(step, jnp.zeros((B, H, K, V), f32), xs)
    return jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, N * C, H, V)[:, :T], s_final


def temp_bytes(fn, T: int, heads: int, dk: int, dv: int, dtype) -> int:
    def loss(q, k, v, g, beta):
        o, s = fn(q, k, v, g, beta)
        return jnp.sum(o * o) + jnp.sum(s)

    args = [
        jax.ShapeDtypeStruct((1, T, heads, dk), dtype),
        jax.ShapeDtypeStruct((1, T, heads, dk), dtype),
        jax.ShapeDtypeStruct((1, T, heads, dv), dtype),
        jax.ShapeDtypeStruct((1, T, heads), f32),
        jax.ShapeDtypeStruct((1, T, heads), f32),
    ]
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="2048,4096,8192,16384")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--no-old", action="store_true", help="skip the pre-custom-VJP implementation")
    args = p.parse_args()
    H, D = args.heads, args.dim
    print(f"backend {jax.default_backend()}: B=1 H={H} dk=dv={D} bf16 inputs, temporaries of value_and_grad")
    for T in (int(s) for s in args.seqs.split(",")):
        new = temp_bytes(chunked_gated_delta_rule, T, H, D, D, jnp.bfloat16)
        line = f"T={T:6d}  custom VJP {new / (T * H):8.0f} B/token/head ({new / 2**20:8.1f} MiB)"
        if not args.no_old:
            old = temp_bytes(_old_chunked, T, H, D, D, jnp.bfloat16)
            line += f"   before {old / (T * H):8.0f} B/token/head ({old / 2**20:8.1f} MiB)   ratio {old / new:.1f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
