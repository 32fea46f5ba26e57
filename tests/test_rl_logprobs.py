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


def masked_case(B=3, T=40, D=16, V=97, seed=1):
    h, w, t = case(B, T, D, V, seed)
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), np.float32)
    for b in range(B - 1):  # scattered spans; the last row has none at all
        for _ in range(2):
            s = int(rng.integers(0, T - 4))
            mask[b, s : s + int(rng.integers(1, 8))] = 1
    return h, w, t, jnp.asarray(mask)


def np_grads(h, w, t, g, temperature):
    """float64 d(sum(g * logprob)) / d(h, w) of the untruncated tempered head."""
    h, w = h.astype(np.float64), w.astype(np.float64)
    logits = h @ w / temperature
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    d = -p
    np.put_along_axis(d, t[..., None], np.take_along_axis(d, t[..., None], -1) + 1.0, -1)
    d *= g[..., None] / temperature
    return d @ w.T, np.einsum("btd,btv->dv", h, d)


@pytest.mark.parametrize("chunk", [1024, 8])  # one chunk (probabilities kept) / chunks recomputed
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("head_vd", [False, True])
def test_masked_head_equals_numpy_values_and_gradients(chunk, temperature, head_vd):
    h, w, t, mask = masked_case()
    g = jax.random.normal(jax.random.key(3), t.shape)
    head = w.T if head_vd else w

    def f(h, head):
        lp = token_logprobs(
            h, head, t, temperature=temperature, chunk_size=chunk, mask_BxT=mask, head_vd=head_vd
        )
        return jnp.sum(lp * g), lp

    (_, lp), (dh, dhead) = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(h, head)
    m = np.asarray(mask) > 0
    ref = np_logprobs(np.asarray(h), np.asarray(w), np.asarray(t), temperature)
    np.testing.assert_allclose(np.asarray(lp)[m], ref[m], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(lp)[~m] == 0.0)
    ref_dh, ref_dw = np_grads(np.asarray(h), np.asarray(w), np.asarray(t), np.asarray(g) * m, temperature)
    np.testing.assert_allclose(np.asarray(dh), ref_dh, rtol=1e-4, atol=1e-5)
    got_dw = np.asarray(dhead).T if head_vd else np.asarray(dhead)
    np.testing.assert_allclose(got_dw, ref_dw, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (7, 0.9)])
@pytest.mark.parametrize("chunk", [1024, 8])
def test_masked_head_truncated_equals_plain_autodiff(top_k, top_p, chunk):
    h, w, t, mask = masked_case(V=61)
    # Targets from each position's top logits, so most are inside the truncated support.
    order = jnp.argsort(-jnp.einsum("btd,dv->btv", h, w), axis=-1)
    t = jnp.take_along_axis(order, (t % 6)[..., None], axis=-1)[..., 0].astype(jnp.int32)
    g = jax.random.normal(jax.random.key(4), t.shape)
    kw = dict(temperature=0.8, top_k=top_k, top_p=top_p)

    def masked(h, w):
        return jnp.sum(token_logprobs(h, w, t, chunk_size=chunk, mask_BxT=mask, **kw) * g)

    def plain(h, w):
        return jnp.sum(jnp.where(mask > 0, token_logprobs_plain(h, w, t, **kw), 0.0) * g)

    np.testing.assert_allclose(float(jax.jit(masked)(h, w)), float(plain(h, w)), rtol=1e-5)
    for a, b in zip(jax.jit(jax.grad(masked, (0, 1)))(h, w), jax.grad(plain, (0, 1))(h, w)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk", [1024, 16])
def test_masked_head_never_reads_positions_outside_the_mask(chunk):
    """Blocks of positions past every row's masked-in count are skipped, forward and backward: NaN
    hidden states there leave the loss and both gradients finite (the whole head would spread them
    into the head's gradient through 0 * NaN)."""
    B, T = 8, 64
    h, w, t = case(B, T, D=16, V=50)
    mask = np.zeros((B, T), np.float32)
    rng = np.random.default_rng(0)
    for b in range(B):  # 16 per row: exactly one block of the sorted positions
        mask[b, rng.choice(T, 16, replace=False)] = 1
    mask = jnp.asarray(mask)
    poisoned = jnp.where(mask[..., None] > 0, h, jnp.nan)

    def loss(fn, h, w):
        return jnp.sum(fn(h, w))

    def masked(h, w):
        return token_logprobs(h, w, t, chunk_size=chunk, mask_BxT=mask)

    def whole(h, w):
        return jnp.where(mask > 0, token_logprobs(h, w, t, chunk_size=chunk), 0.0)

    v, (dh, dw) = jax.jit(jax.value_and_grad(lambda h, w: loss(masked, h, w), (0, 1)))(poisoned, w)
    assert np.isfinite(float(v)) and np.all(np.isfinite(np.asarray(dw)))
    assert np.all(np.isfinite(np.asarray(dh)[np.asarray(mask) > 0]))
    ref_v, (ref_dh, ref_dw) = jax.value_and_grad(lambda h, w: loss(whole, h, w), (0, 1))(h, w)
    np.testing.assert_allclose(float(v), float(ref_v), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(ref_dw), rtol=1e-4, atol=1e-6)
    # The check can fail: the whole head on the same input does spread the NaNs.
    bad = jax.grad(lambda h, w: loss(whole, h, w), 1)(poisoned, w)
    assert not np.all(np.isfinite(np.asarray(bad)))


def test_masked_head_bad_mask_shape_raises():
    h, w, t = case(T=8)
    with pytest.raises(LogprobInputError, match="mask must be"):
        token_logprobs(h, w, t, mask_BxT=jnp.ones((2, 9)))
