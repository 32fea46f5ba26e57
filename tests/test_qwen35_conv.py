"""The Gated DeltaNet's causal depthwise conv and its own backward pass against a float64 NumPy
reference: values, the input gradient and the weight gradient, with packed groups and a length that
spans several of the weight gradient's time blocks (and a ragged last one)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.models.qwen35 import deltanet


def reference(x, w, groups):
    """float64 out[b, t] = sum_j w[j] x[b, t-(K-1)+j] over taps inside t's group; and its VJP."""
    B, T, C = x.shape
    K = w.shape[0]
    out = np.zeros((B, T, C))
    taps = []  # (b, t, src, j)
    for b in range(B):
        for t in range(T):
            for j in range(K):
                src = t - (K - 1) + j
                if src >= 0 and groups[b, src] == groups[b, t]:
                    out[b, t] += w[j] * x[b, src]
                    taps.append((b, t, src, j))
    return out, taps


def reference_vjp(x, w, taps, d):
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for b, t, src, j in taps:
        dx[b, src] += w[j] * d[b, t]
        dw[j] += x[b, src] * d[b, t]
    return dx, dw


@pytest.mark.parametrize("T", [5, 1100])
def test_conv_and_its_gradients_match_float64(monkeypatch, T):
    monkeypatch.setattr(deltanet, "_CONV_GRAD_BLOCK", 256)  # several blocks, a ragged last one
    rng = np.random.default_rng(0)
    B, C, K = 2, 6, 4
    x = rng.standard_normal((B, T, C))
    w = rng.standard_normal((K, C))
    d = rng.standard_normal((B, T, C))
    groups = np.zeros((B, T), np.int32)
    groups[0, T // 3 :] = 1  # row 0 packs two sequences; row 1 is one
    groups[0, T - 2 :] = 2
    want, taps = reference(x, w, groups)
    want_dx, want_dw = reference_vjp(x, w, taps, d)

    f = jax.jit(lambda x, w: deltanet.causal_depthwise_conv(x, w, jnp.asarray(groups)))
    out, vjp = jax.vjp(f, jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    dx, dw = vjp(jnp.asarray(d, jnp.float32))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=1e-4 * np.sqrt(T))


def test_bfloat16_inputs_give_gradients_in_their_dtypes():
    x = jnp.ones((1, 9, 4), jnp.bfloat16)
    w = jnp.ones((4, 4), jnp.float32)
    dx, dw = jax.grad(
        lambda x, w: (
            deltanet.causal_depthwise_conv(x, w.astype(jnp.bfloat16), jnp.zeros((1, 9), jnp.int32))
            .astype(jnp.float32)
            .sum()
        ),
        argnums=(0, 1),
    )(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    # Token t feeds outputs t..t+3 that exist: 4 of them but near the end.
    np.testing.assert_array_equal(np.asarray(dx[0, :, 0], np.float32), [4, 4, 4, 4, 4, 4, 3, 2, 1])
    np.testing.assert_array_equal(np.asarray(dw[:, 0]), [6, 7, 8, 9])
