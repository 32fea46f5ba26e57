"""Chunked float32 token logprobs: equal to the plain full-logits version and to NumPy, without [B,T,V]."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.rl import LogprobInputError, token_logprobs, token_logprobs_plain

pytestmark = pytest.mark.strict_ranks


def np_logprobs(h, w, t, temperature):
    logits = (h.astype(np.float64) @ w.astype(np.float64)) / temperature
    m = logits.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
    return np.take_along_axis(logits, t[..., None], -1)[..., 0] - lse


def case(B=2, T=37, D=16, V=300, seed=0, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k1, (B, T, D), jnp.float32).astype(dtype)
    w = (0.3 * jax.random.normal(k2, (D, V), jnp.float32)).astype(dtype)
    t = jax.random.randint(k3, (B, T), 0, V, jnp.int32)
    return h, w, t


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_plain_and_numpy(chunk, temperature):
    h, w, t = case()
    got = jax.jit(lambda h, w, t: token_logprobs(h, w, t, temperature=temperature, chunk_size=chunk))(h, w, t)
    plain = token_logprobs_plain(h, w, t, temperature=temperature)
    assert got.dtype == jnp.float32 and got.shape == t.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), rtol=1e-6, atol=1e-6)
    ref = np_logprobs(np.asarray(h), np.asarray(w), np.asarray(t), temperature)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


def test_chunked_gradients_equal_plain():
    h, w, t = case(T=29)
    weights = jax.random.normal(jax.random.key(5), t.shape)

    def loss(fn, h, w):
        return jnp.sum(fn(h, w, t) * weights)

    g_chunk = jax.grad(lambda h, w: loss(lambda *a: token_logprobs(*a, chunk_size=8), h, w), (0, 1))(h, w)
    g_plain = jax.grad(lambda h, w: loss(token_logprobs_plain, h, w), (0, 1))(h, w)
    for a, b in zip(g_chunk, g_plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_bfloat16_inputs_use_float32_head():
    h, w, t = case(dtype=jnp.bfloat16)
    got = token_logprobs(h, w, t, chunk_size=16)
    assert got.dtype == jnp.float32
    # Same as casting to float32 first: the head itself never runs in bfloat16.
    ref = np_logprobs(
        np.asarray(h.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), np.asarray(t), 1.0
    )
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


def test_chunking_bounds_the_logits_buffer():
    B, T, D, V = 1, 1024, 8, 2048
    h, w, t = case(B, T, D, V)
    full_bytes = B * T * V * 4

    def temp_bytes(fn):
        grad = jax.jit(jax.grad(lambda h, w: jnp.sum(fn(h, w, t)), (0, 1)))
        return grad.lower(h, w).compile().memory_analysis().temp_size_in_bytes

    plain = temp_bytes(token_logprobs_plain)
    chunked = temp_bytes(lambda h, w, t: token_logprobs(h, w, t, chunk_size=64))
    assert plain >= full_bytes  # the reference really materialises [B, T, V]
    assert chunked < full_bytes / 4, (chunked, plain)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((2, 5), (4, 9), (2, 5)), "hidden must be"),
        (((2, 5, 4), (3, 9), (2, 5)), "lm_head must be"),
        (((2, 5, 4), (4, 9), (2, 6)), "targets must be"),
    ],
)
def test_bad_shapes_raise(shapes, match):
    h, w, t = (jnp.zeros(s, jnp.int32 if i == 2 else jnp.float32) for i, s in enumerate(shapes))
    with pytest.raises(LogprobInputError, match=match):
        token_logprobs(h, w, t)


def test_float_targets_and_bad_temperature_raise():
    h, w, t = case(T=4)
    with pytest.raises(LogprobInputError, match="integer"):
        token_logprobs(h, w, t.astype(jnp.float32))
    with pytest.raises(LogprobInputError, match="temperature"):
        token_logprobs(h, w, t, temperature=0.0)
