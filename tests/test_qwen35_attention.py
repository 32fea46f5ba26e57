"""Masked GQA attention core: query-blocked == unblocked (values and gradients) == a NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np

from tmax_jax.models.qwen35.attention import masked_attention


def numpy_attention(q, k, v, seg):
    B, T, G, R, E = q.shape
    out = np.zeros_like(q, dtype=np.float64)
    for b in range(B):
        for t in range(T):
            ok = (np.arange(T) <= t) & (seg[b] == seg[b, t])
            for g in range(G):
                s = k[b, ok, g] @ q[b, t, g].T / np.sqrt(E)  # [S_ok, R]
                p = np.exp(s - s.max(0))
                p /= p.sum(0)
                out[b, t, g] = (p.T @ v[b, ok, g]).astype(np.float64)
    return out


def test_blocked_and_unblocked_attention_match_numpy_with_packing_and_padding():
    rng = np.random.default_rng(0)
    B, T, G, R, E = 2, 150, 2, 2, 8
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in [(B, T, G, R, E), (B, T, G, E), (B, T, G, E)])
    seg = np.ones((B, T), np.int32)
    seg[0, 60:] = 2
    seg[1, 140:] = 0
    idx = jnp.broadcast_to(jnp.arange(T), (B, T))

    def run(q, block):
        return masked_attention(q, k, v, idx, seg, jnp.arange(T), seg, block=block)

    full = np.asarray(run(q, 1024))
    np.testing.assert_allclose(full, numpy_attention(q, k, v, seg), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(run(q, 32)), full, atol=1e-6, rtol=1e-6)
    g_full = jax.grad(lambda q: (run(q, 1024) ** 2).sum())(q)
    g_blk = jax.grad(lambda q: (run(q, 32) ** 2).sum())(q)
    np.testing.assert_allclose(np.asarray(g_blk), np.asarray(g_full), atol=1e-5, rtol=1e-5)
