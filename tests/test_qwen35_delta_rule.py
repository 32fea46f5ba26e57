"""The gated delta rule: chunked == recurrent == a NumPy loop == transformers' torch reference,
packing restarts the state exactly, and pads are no-ops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.models.qwen35.delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule


def numpy_delta_rule(q, k, v, g, beta, s0=None, groups=None):
    """Straight per-token loop in float64; the state restarts from zero when the group changes."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    out = np.zeros((B, T, H, V))
    finals = np.zeros((B, H, K, V))
    for b in range(B):
        s = np.zeros((H, K, V)) if s0 is None else s0[b].astype(np.float64)
        prev = 0
        for t in range(T):
            grp = 0 if groups is None else groups[b, t]
            if grp != prev:
                s = np.zeros((H, K, V))
                prev = grp
            s = s * np.exp(g[b, t])[:, None, None]
            pred = np.einsum("hk,hkv->hv", k[b, t], s)
            delta = (v[b, t] - pred) * beta[b, t][:, None]
            s = s + k[b, t][:, :, None] * delta[:, None, :]
            out[b, t] = np.einsum("hk,hkv->hv", q[b, t], s)
        finals[b] = s
    return out, finals


def make_inputs(seed, B=2, T=150, H=3, K=8, V=6):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, K))
    k = rng.normal(size=(B, T, H, K))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * K**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, T, H, V))
    g = -np.log1p(np.exp(rng.normal(size=(B, T, H))))  # -softplus: decays in (0, 1)
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
    s0 = rng.normal(size=(B, H, K, V))
    return [x.astype(np.float32) for x in (q, k, v, g, beta, s0)]


chunked = jax.jit(chunked_gated_delta_rule, static_argnames="chunk_size")
recurrent = jax.jit(recurrent_gated_delta_rule)


def test_chunked_equals_recurrent_equals_numpy():
    q, k, v, g, beta, s0 = make_inputs(0)
    ref_o, ref_s = numpy_delta_rule(q, k, v, g, beta, s0)
    o_c, s_c = chunked(q, k, v, g, beta, s0)
    o_r, s_r = recurrent(q, k, v, g, beta, s0)
    assert o_c.dtype == jnp.float32 and s_c.dtype == jnp.float32
    np.testing.assert_allclose(o_c, ref_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s_c, ref_s, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(o_r, ref_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s_r, ref_s, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_matches_transformers_torch_reference(chunk_size):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    q, k, v, g, beta, s0 = make_inputs(1, T=100)
    o, s = chunked(q, k, v, g, beta, s0, chunk_size=chunk_size)
    # transformers scales q by dk^-0.5 itself (our inputs come pre-scaled) and is left to not
    # re-normalise (our q/k are already unit vectors).
    t = [torch.from_numpy(x) for x in (q * q.shape[-1] ** 0.5, k, v, g, beta, s0)]
    ref_o, ref_s = ref.torch_chunk_gated_delta_rule(
        t[0],
        t[1],
        t[2],
        g=t[3],
        beta=t[4],
        chunk_size=chunk_size,
        initial_state=t[5],
        output_final_state=True,
    )
    np.testing.assert_allclose(o, ref_o.numpy(), atol=3e-5, rtol=1e-4)
    np.testing.assert_allclose(s, ref_s.numpy(), atol=3e-5, rtol=1e-4)


def test_packed_groups_restart_state_exactly():
    q, k, v, g, beta, _ = make_inputs(2, B=1, T=150)
    # Three packed segments, boundaries inside and across 64-token chunks.
    groups = np.zeros((1, 150), np.int32)
    groups[0, :40], groups[0, 40:101], groups[0, 101:] = 1, 2, 3
    o, s = chunked(q, k, v, g, beta, None, jnp.asarray(groups))
    ref_o, ref_s = numpy_delta_rule(q, k, v, g, beta, None, groups)
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s, ref_s, atol=2e-5, rtol=1e-4)
    # Each segment alone from a zero state gives the same outputs.
    for lo, hi in [(0, 40), (40, 101), (101, 150)]:
        o_seg, _ = chunked(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], None)
        np.testing.assert_allclose(o[:, lo:hi], o_seg, atol=2e-5, rtol=1e-4)


def test_tokens_with_zero_decay_and_beta_leave_the_state_unchanged():
    q, k, v, g, beta, s0 = make_inputs(3, T=90)
    n = 70
    g2, beta2 = g.copy(), beta.copy()
    g2[:, n:], beta2[:, n:] = 0.0, 0.0
    _, s_pad = chunked(q, k, v, g2, beta2, s0)
    _, s_trim = chunked(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0)
    np.testing.assert_allclose(s_pad, s_trim, atol=1e-6, rtol=1e-6)
    _, s_step = recurrent(q[:, :1], k[:, :1], v[:, :1], g2[:, n : n + 1], beta2[:, n : n + 1], s0)
    np.testing.assert_array_equal(s_step, s0)
