"""Sampling math against NumPy: tempered logprobs, top-k / top-p support, the sampled distribution, seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.engine import sampling
from tmax_jax.engine.sampling import SamplingParams
from tmax_jax.errors import ConfigError


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_support(logits, t, k, p):
    """The set of token ids a (temperature t, top-k k, top-p p) sampler may draw, by brute force."""
    scaled = logits / t
    order = np.argsort(-scaled, kind="stable")
    keep = np.ones(len(logits), bool)
    if k > 0:
        keep[:] = False
        keep[order[:k]] = True
        kth = scaled[order[k - 1]]
        keep |= scaled >= kth  # ties with the k-th are kept
    probs = np.exp(np_log_softmax(scaled))
    if p < 1.0:
        nucleus = np.zeros(len(logits), bool)
        mass = 0.0
        for i in order:
            if mass < p:
                nucleus[i] = True
            mass += probs[i]
        pth = scaled[order[nucleus[order].sum() - 1]]
        nucleus |= scaled >= pth
        keep &= nucleus
    return set(np.flatnonzero(keep).tolist())


@pytest.fixture(scope="module")
def logits():
    return np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32) * 2.0


def test_token_logprob_matches_numpy(logits):
    temps = np.array([0.0, 0.5, 1.0, 1.7, 0.0, 3.0], np.float32)
    toks = np.array([3, 7, 11, 0, 49, 25], np.int32)
    got = np.asarray(sampling.token_logprob(jnp.asarray(logits), jnp.asarray(toks), jnp.asarray(temps)))
    for i, (t, tok) in enumerate(zip(temps, toks)):
        ref = np_log_softmax(logits[i] / (t if t > 0 else 1.0))[tok]
        np.testing.assert_allclose(got[i], ref, rtol=1e-5, atol=1e-5)


def test_greedy_rows_take_argmax_and_plain_logprob(logits):
    n = logits.shape[0]
    keys = jax.random.split(jax.random.key(0), n)
    temps = jnp.zeros((n,), jnp.float32)
    toks, lps = sampling.sample(jnp.asarray(logits), keys, temps, jnp.zeros((n,), jnp.int32), jnp.ones((n,)))
    np.testing.assert_array_equal(np.asarray(toks), logits.argmax(-1))
    ref = np_log_softmax(logits)[np.arange(n), logits.argmax(-1)]
    np.testing.assert_allclose(np.asarray(lps), ref, rtol=1e-5, atol=1e-6)


def test_first_argmax_is_numpy_argmax_with_ties_infinities_and_nans():
    rng = np.random.default_rng(1)
    x = rng.integers(-3, 3, size=(12, 300)).astype(np.float32)  # many ties for the maximum
    x[1] = -np.inf  # every logit masked
    x[2, 17] = np.inf
    x[2, 40] = np.inf
    x[3, 5] = np.nan  # NumPy (and jnp.argmax) return the first NaN
    x[3, 9] = np.nan
    x[4, -1] = 10.0
    got = np.asarray(sampling.first_argmax(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got.dtype == np.int32


def test_draws_are_jax_categorical_and_argmax_bit_for_bit():
    """The fused draw (one argmax over Gumbel noise + kept logits, or the logits for greedy rows) picks
    exactly the tokens of ``jax.random.categorical`` per row and ``jnp.argmax`` for greedy rows, so
    seeds give the same samples as before it."""
    rng = np.random.default_rng(2)
    S, V = 16, 1000
    logits = jnp.asarray(rng.normal(size=(S, V)).astype(np.float32) * 3.0)
    keys = jax.random.split(jax.random.key(7), S)
    temps = jnp.asarray(np.where(np.arange(S) % 4 == 0, 0.0, 0.4 + np.arange(S) / 8).astype(np.float32))
    top_k = jnp.asarray(np.where(np.arange(S) % 3 == 1, 20, 0).astype(np.int32))
    top_p = jnp.asarray(np.where(np.arange(S) % 5 == 2, 0.8, 1.0).astype(np.float32))
    toks, _ = jax.jit(sampling.sample)(logits, keys, temps, top_k, top_p)
    greedy = temps <= sampling.GREEDY_EPS
    kept = sampling.filter_logits(
        logits / jnp.where(greedy, 1.0, temps)[:, None],
        jnp.where(greedy, 0, top_k),
        jnp.where(greedy, 1.0, top_p),
    )
    ref = jnp.where(greedy, jnp.argmax(logits, axis=-1), jax.vmap(jax.random.categorical)(keys, kept))
    np.testing.assert_array_equal(np.asarray(toks), np.asarray(ref))
    assert len(set(np.asarray(toks)[~np.asarray(greedy)].tolist())) > 3  # real draws, not all one token


@pytest.mark.parametrize(
    "t,k,p", [(1.0, 5, 1.0), (0.7, 0, 0.6), (1.3, 10, 0.8), (1.0, 1, 1.0), (2.0, 0, 0.05)]
)
def test_filter_support_matches_numpy(logits, t, k, p):
    n = logits.shape[0]
    scaled = jnp.asarray(logits / t)
    out = np.asarray(sampling.filter_logits(scaled, jnp.full((n,), k), jnp.full((n,), p, jnp.float32)))
    for i in range(n):
        assert set(np.flatnonzero(np.isfinite(out[i])).tolist()) == np_support(logits[i], t, k, p)


def test_samples_stay_in_support_and_logprob_is_of_the_truncated_distribution(logits):
    n, draws = logits.shape[0], 200
    t, k, p = 0.9, 8, 0.7
    keys = jax.random.split(jax.random.key(1), draws * n).reshape(draws, n)
    fn = jax.jit(jax.vmap(lambda kk: sampling.sample(
        jnp.asarray(logits), kk, jnp.full((n,), t), jnp.full((n,), k), jnp.full((n,), p)
    )))  # fmt: skip
    toks, lps = (np.asarray(x) for x in fn(keys))
    for i in range(n):
        support = np_support(logits[i], t, k, p)
        assert set(toks[:, i].tolist()) <= support
        # float64 log-softmax of logits / t renormalised over the support the token was drawn from.
        z = logits[i].astype(np.float64) / t
        keep = np.array(sorted(support))
        ref_lp = z - (z[keep].max() + np.log(np.exp(z[keep] - z[keep].max()).sum()))
        np.testing.assert_allclose(lps[:, i], ref_lp[toks[:, i]], rtol=1e-5, atol=1e-5)


def test_sampled_frequencies_follow_tempered_softmax():
    row = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    t, draws = 1.5, 20000
    keys = jax.random.split(jax.random.key(7), draws)
    toks, _ = sampling.sample(
        jnp.tile(row, (draws, 1)),
        keys,
        jnp.full((draws,), t),
        jnp.zeros((draws,), jnp.int32),
        jnp.ones((draws,)),
    )
    freq = np.bincount(np.asarray(toks), minlength=len(row)) / draws
    probs = np.exp(np_log_softmax(row / t))
    # 5 standard errors of a binomial proportion: fails for a wrong temperature, not by chance.
    np.testing.assert_array_less(np.abs(freq - probs), 5 * np.sqrt(probs * (1 - probs) / draws) + 1e-3)


def test_step_keys_depend_only_on_seed_and_step():
    base = jnp.stack([sampling.request_key(3), sampling.request_key(4), sampling.request_key(3)])
    a = jax.random.key_data(sampling.step_keys(base, jnp.array([0, 0, 0])))
    b = jax.random.key_data(sampling.step_keys(base, jnp.array([0, 0, 1])))
    assert np.array_equal(a[0], a[2]) and not np.array_equal(a[0], a[1])
    assert not np.array_equal(a[2], b[2])


@pytest.mark.parametrize(
    "kwargs,msg",
    [({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"seed": 1.5}, "seed")],
)  # fmt: skip
def test_bad_sampling_params_are_named(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        SamplingParams(**kwargs)


def test_threefry2x32_known_answers():
    """Random123's published Threefry-2x32 (20 rounds) known-answer vectors, and JAX's own hash."""
    from jax.extend.random import threefry_2x32

    u = np.uint32
    cases = [  # (key, counter, expected)
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ]
    for key, ctr, want in cases:
        got = sampling.threefry2x32(*(jnp.asarray(u(v)) for v in (*key, *ctr)))
        assert tuple(int(w) for w in got) == want
    key = jnp.asarray([0x9E3779B9, 0x7F4A7C15], jnp.uint32)
    ctr = jnp.arange(2 * 999, dtype=jnp.uint32)
    mine = np.concatenate(
        [np.asarray(w) for w in sampling.threefry2x32(key[0], key[1], ctr[:999], ctr[999:])]
    )
    np.testing.assert_array_equal(mine, np.asarray(threefry_2x32(key, ctr)))


@pytest.mark.parametrize("S,V", [(8, 4096), (3, 1001), (1, 7), (2, 250_000)])
def test_gumbel_rows_are_jax_gumbel_bit_for_bit(S, V):
    """The unrolled-hash noise is JAX's per-row ``random.gumbel`` exactly, so seeds keep their
    samples."""
    keys = jax.random.split(jax.random.key(11 + S), S)
    keys = jax.vmap(jax.random.fold_in)(keys, jnp.arange(S, dtype=jnp.uint32) * 977 + 3)
    ref = jax.jit(lambda k: jax.vmap(lambda r: jax.random.gumbel(r, (V,), jnp.float32))(k))(keys)
    got = jax.jit(lambda k: sampling.gumbel_rows(k, V))(keys)
    assert got.shape == (S, V) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(ref).view(np.uint32))
    assert np.isfinite(np.asarray(got)).all()


def test_gumbel_rows_defer_to_jax_where_it_draws_otherwise():
    """Another key implementation, another dtype or high-range Gumbel: JAX's draw, unchanged."""
    V = 257
    rbg = jax.random.split(jax.random.key(3, impl="rbg"), 2)
    ref = jax.vmap(lambda r: jax.random.gumbel(r, (V,), jnp.float32))(rbg)
    np.testing.assert_array_equal(np.asarray(sampling.gumbel_rows(rbg, V)), np.asarray(ref))
    keys = jax.random.split(jax.random.key(4), 2)
    ref16 = jax.vmap(lambda r: jax.random.gumbel(r, (V,), jnp.bfloat16))(keys)
    np.testing.assert_array_equal(
        np.asarray(sampling.gumbel_rows(keys, V, jnp.bfloat16), np.float32), np.asarray(ref16, np.float32)
    )
    before = jax.config.jax_high_dynamic_range_gumbel
    jax.config.update("jax_high_dynamic_range_gumbel", True)
    try:
        high = jax.vmap(lambda r: jax.random.gumbel(r, (V,), jnp.float32))(keys)
        np.testing.assert_array_equal(np.asarray(sampling.gumbel_rows(keys, V)), np.asarray(high))
    finally:
        jax.config.update("jax_high_dynamic_range_gumbel", before)
    low = jax.vmap(lambda r: jax.random.gumbel(r, (V,), jnp.float32))(keys)
    assert not np.array_equal(np.asarray(high), np.asarray(low))  # the switch did change JAX's draw
