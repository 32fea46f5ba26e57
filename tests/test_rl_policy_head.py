"""One policy head for engine, trainer and SFT: the engine's sampled-token logprobs equal the
trainer's recomputation (float32, 1e-6) and a NumPy float64 reference; truncated (top-k / top-p)
logprobs match NumPy and the sampler's own filter; the bfloat16 engine/trainer gap is measured."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tmax_jax.engine import Engine, SamplingParams, sampling
from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.rl.logprobs import (
    TRUNCATED_LOGPROB_FLOOR,
    LogprobInputError,
    head_logits,
    logprobs_from_logits,
    token_logprobs,
    token_logprobs_plain,
    truncation_threshold,
)
from tmax_jax.rl.train_step import make_model


def np_truncated_logprob(logits, tokens, temperature, top_k, top_p):
    """float64 reference: the tempered distribution restricted to top-k and the nucleus, renormalised."""
    out = []
    for row, tok, t, k, p in zip(logits.astype(np.float64), tokens, temperature, top_k, top_p):
        z = row / (t if t > 1e-5 else 1.0)
        order = np.argsort(-z, kind="stable")
        keep = np.zeros(z.shape, bool)
        n_k = len(z) if k <= 0 else min(k, len(z))
        probs = np.exp(z[order] - z.max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        n_p = max(int((before < p).sum()), 1) if p < 1 else len(z)
        n = min(n_k, n_p)
        keep[z >= z[order[n - 1]]] = True  # ties at the boundary are kept, as in the sampler
        if not keep[tok]:
            out.append(TRUNCATED_LOGPROB_FLOOR)
            continue
        lse = z[keep].max() + np.log(np.exp(z[keep] - z[keep].max()).sum())
        out.append(z[tok] - lse)
    return np.array(out)


def rand_case(seed, S=16, D=24, V=97):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(S, D)).astype(np.float32)
    w = (0.4 * rng.normal(size=(D, V))).astype(np.float32)
    return h, w


@pytest.mark.strict_ranks
def test_sampler_and_trainer_logprobs_agree_in_float32_and_with_numpy():
    h, w = rand_case(0)
    S = h.shape[0]
    temps = np.array([1.0, 0.7, 0.0, 1.3] * (S // 4), np.float32)  # 0.0: greedy
    keys = jax.vmap(jax.random.key)(jnp.arange(S))
    tokens, engine_lp = jax.jit(sampling.sample)(
        head_logits(jnp.asarray(h), jnp.asarray(w)),
        keys,
        jnp.asarray(temps),
        jnp.zeros((S,), jnp.int32),
        jnp.ones((S,), jnp.float32),
    )
    tokens, engine_lp = np.asarray(tokens), np.asarray(engine_lp)
    for t in np.unique(temps):
        rows = temps == t
        trainer = token_logprobs(
            jnp.asarray(h[rows][None]),
            jnp.asarray(w),
            jnp.asarray(tokens[rows][None]),
            temperature=float(t or 1.0),
        )[0]
        np.testing.assert_allclose(engine_lp[rows], np.asarray(trainer), rtol=0, atol=1e-6)
    ref = np_truncated_logprob(h.astype(np.float64) @ w, tokens, temps, np.zeros(S), np.ones(S))
    np.testing.assert_allclose(engine_lp, ref, rtol=0, atol=2e-6)


@pytest.mark.strict_ranks
@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (7, 0.6), (1, 1.0), (0, 0.05)])
def test_truncated_logprobs_match_numpy_and_the_sampler_filter(top_k, top_p):
    h, w = rand_case(1)
    S, V = h.shape[0], w.shape[1]
    logits = head_logits(jnp.asarray(h), jnp.asarray(w))
    temps = np.full((S,), 0.8, np.float32)
    k_S, p_S = jnp.full((S,), top_k, jnp.int32), jnp.full((S,), top_p, jnp.float32)
    keys = jax.vmap(jax.random.key)(jnp.arange(S) + 100)
    drawn, _ = sampling.sample(logits, keys, jnp.asarray(temps), k_S, p_S)
    # The head's truncated support is exactly the set the sampler draws from.
    scaled = logits / 0.8
    thr = truncation_threshold(scaled, k_S, p_S)
    np.testing.assert_array_equal(
        np.asarray(scaled >= thr[:, None]), np.isfinite(np.asarray(sampling.filter_logits(scaled, k_S, p_S)))
    )
    # Every sampled token is inside it, and also some token outside it gets the floor.
    tokens = np.asarray(drawn).copy()
    outside = np.asarray(jnp.argmin(scaled, axis=-1))
    tokens[::3] = outside[::3]
    got = np.asarray(logprobs_from_logits(logits, jnp.asarray(tokens), jnp.asarray(temps), k_S, p_S))
    ref = np_truncated_logprob(h.astype(np.float64) @ w, tokens, temps, [top_k] * S, [top_p] * S)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6)
    in_support = np.asarray(logprobs_from_logits(logits, drawn, jnp.asarray(temps), k_S, p_S))
    assert np.all(in_support > TRUNCATED_LOGPROB_FLOOR) and np.all(in_support <= 0)
    if top_k == 1:
        np.testing.assert_array_equal(in_support, 0.0)  # one token left: probability 1
    # The trainer's chunked, batched form gives the same numbers and finite gradients.
    chunked = token_logprobs(
        jnp.asarray(h[None]),
        jnp.asarray(w),
        jnp.asarray(tokens[None]),
        temperature=0.8,
        top_k=top_k,
        top_p=top_p,
        chunk_size=5,
    )[0]
    np.testing.assert_allclose(np.asarray(chunked), got, rtol=0, atol=1e-6)
    g = jax.grad(
        lambda hh: jnp.sum(
            token_logprobs_plain(
                hh, jnp.asarray(w), jnp.asarray(tokens[None]), temperature=0.8, top_k=top_k, top_p=top_p
            )
        )
    )(jnp.asarray(h[None]))
    assert np.all(np.isfinite(np.asarray(g))) and V == 97


@pytest.mark.strict_ranks
def test_truncated_logprob_gradient_matches_numpy():
    """d/d logits of the truncated logprob: onehot(token) - softmax over the kept set (0 outside)."""
    h, w = rand_case(2, S=6)
    logits = np.asarray(head_logits(jnp.asarray(h), jnp.asarray(w)))
    tokens = np.argsort(-logits, axis=-1)[:, 2]  # the third most likely token: inside top-4
    g = jax.grad(lambda x: jnp.sum(logprobs_from_logits(x, jnp.asarray(tokens), 1.0, 4, None)))(
        jnp.asarray(logits)
    )
    for row, tok, grow in zip(logits.astype(np.float64), tokens, np.asarray(g)):
        keep = row >= np.sort(row)[-4]
        p = np.where(keep, np.exp(row - row.max()), 0.0)
        p /= p.sum()
        ref = -p
        ref[tok] += 1.0
        np.testing.assert_allclose(grow, ref, rtol=0, atol=1e-6)


@pytest.mark.strict_ranks
@pytest.mark.parametrize("top_k, top_p, match", [(-1, 1.0, "top_k"), (0, 0.0, "top_p"), (0, 1.5, "top_p")])
def test_bad_truncation_is_rejected(top_k, top_p, match):
    h, w = rand_case(3, S=4)
    with pytest.raises(LogprobInputError, match=match):
        token_logprobs(
            jnp.asarray(h[None]), jnp.asarray(w), jnp.zeros((1, 4), jnp.int32), top_k=top_k, top_p=top_p
        )


@pytest.mark.strict_ranks  # the model code broadcasts explicitly (rope, norms, DeltaNet, delta rule, MoE)
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-moe"])
def test_model_logits_are_the_head_of_its_hidden_states(preset):
    model = make_model(Qwen35Config.preset(preset), remat="none", seed=3)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9)), jnp.int32)
    want = head_logits(model.hidden_states(ids), model.lm_head_weight())
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(want))


def _grads_and_decode(preset: str):
    """The head's parameter gradients on a row, and an engine's cached greedy decode of a prompt."""
    model = make_model(Qwen35Config.preset(preset), remat="none", seed=5)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 10)), jnp.int32)

    def loss(p):
        m = nnx.merge(graphdef, p, rest)
        hidden = m.hidden_states(ids[:, :-1])
        return token_logprobs(hidden, m.lm_head_weight(), ids[:, 1:], temperature=0.7).sum()

    grads = jax.jit(jax.grad(loss))(params)
    engine = Engine(model, max_concurrent_decodes=2, max_cache_length=32, max_prefill_length=16)
    padded = np.zeros((16,), np.int32)
    padded[:7] = [5, 9, 2, 6, 5, 3, 5]
    engine_params = engine.load_params()
    prefix, first = engine.prefill(params=engine_params, padded_tokens=jnp.asarray(padded), true_length=7)
    state = engine.insert(prefix, engine.init_decode_state(), 1)
    tokens, lps = [np.asarray(first.data)[0, 0]], [np.asarray(first.log_prob)[0, 0]]
    for _ in range(4):
        state, res = engine.generate(engine_params, state)
        tokens.append(np.asarray(res.data)[1, 0])
        lps.append(np.asarray(res.log_prob)[1, 0])
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(grads)}
    return flat, np.asarray(tokens), np.asarray(lps)


@pytest.mark.strict_ranks
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-moe"])
def test_qwen3_and_moe_gradients_and_cached_decode_are_rank_strict(preset):
    """Qwen3 dense and the MoE model (router, experts, shared expert) take their parameter gradients
    and decode through the engine's cache without an implicit rank broadcast (the mark raises on
    one), and give bit for bit what the same calls give under the default promotion."""
    strict = _grads_and_decode(preset)
    with jax.numpy_rank_promotion("allow"):
        loose = _grads_and_decode(preset)
    grads, tokens, lps = strict
    assert sorted(grads) == sorted(loose[0]) and any(np.abs(g).max() > 0 for g in grads.values())
    for k in grads:
        np.testing.assert_array_equal(grads[k], loose[0][k], err_msg=k)
    np.testing.assert_array_equal(tokens, loose[1])
    np.testing.assert_array_equal(lps, loose[2])


def engine_vs_trainer_gap(dtype, prompt_len=11, new_tokens=6, temperature=0.9, top_k=0, top_p=1.0):
    """max |engine logprob - trainer logprob| over a prefill's first token and decoded tokens, and
    max |engine logprob - float64 NumPy logprob of the (truncated) tempered distribution|."""
    model = make_model(Qwen35Config.preset("tiny"), remat="none", dtype=dtype, seed=4)
    engine = Engine(model, max_concurrent_decodes=1, max_cache_length=64, max_prefill_length=16)
    prompt = np.random.default_rng(1).integers(0, 256, prompt_len).astype(np.int32)
    padded = np.zeros((16,), np.int32)
    padded[:prompt_len] = prompt
    params = engine.load_params()
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
    prefix, first = engine.prefill(
        params=params, padded_tokens=jnp.asarray(padded), true_length=prompt_len, sampling_params=sp
    )
    tokens, lps = [int(np.asarray(first.data)[0, 0])], [float(np.asarray(first.log_prob)[0, 0])]
    state = engine.insert(prefix, engine.init_decode_state(), 0)
    for _ in range(new_tokens - 1):
        state, res = engine.generate(params, state)
        tokens.append(int(np.asarray(res.data)[0, 0]))
        lps.append(float(np.asarray(res.log_prob)[0, 0]))
    seq = jnp.asarray(np.concatenate([prompt, tokens])[None], jnp.int32)
    hidden = model.hidden_states(seq[:, :-1])
    trainer = token_logprobs(
        hidden, model.lm_head_weight(), seq[:, 1:], temperature=temperature, top_k=top_k, top_p=top_p
    )
    trainer = np.asarray(trainer)[0, prompt_len - 1 :]
    logits64 = np.asarray(hidden, np.float64)[0, prompt_len - 1 :] @ np.asarray(
        model.lm_head_weight(), np.float64
    )
    n = len(tokens)
    ref = np_truncated_logprob(logits64, tokens, [temperature] * n, [top_k] * n, [top_p] * n)
    engine_lp = np.asarray(lps)
    return (
        float(np.abs(trainer[0] - engine_lp[0])),
        float(np.abs(trainer - engine_lp).max()),
        float(np.abs(ref - engine_lp).max()),
    )


def test_engine_and_trainer_logprobs_agree_float32_and_bfloat16_gap_is_bounded():
    # float32 with top-k and top-p on: the engine reports the truncated distribution's logprobs,
    # which the trainer's head at the same loss.top_k / top_p recomputes.
    first_f32, all_f32, ref_f32 = engine_vs_trainer_gap(jnp.float32, top_k=40, top_p=0.9)
    # Prefill's first token runs the same forward and the same head: float32 agreement to 1e-6.
    assert first_f32 <= 1e-6, first_f32
    # Decoded tokens go through the cache (recurrent delta rule vs the chunked one): float32 rounding.
    assert all_f32 <= 3e-5, all_f32
    assert ref_f32 <= 3e-5, ref_f32
    first_bf16, all_bf16, _ = engine_vs_trainer_gap(jnp.bfloat16)
    print(
        f"engine-trainer |dlogp|: f32 first {first_f32:.2e} all {all_f32:.2e}; bf16 first {first_bf16:.2e} all {all_bf16:.2e}"
    )
    assert np.isfinite(all_bf16) and all_bf16 < 0.5


def np_kept(z, k, p):
    """float64 reference of the kept set of one row (top-k and nucleus, ties at the boundary kept),
    and the distance of the nucleus decision from ``p`` (float32 may decide differently when tiny)."""
    z = z.astype(np.float64)
    order = np.argsort(-z, kind="stable")
    probs = np.exp(z[order] - z.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    n_p = max(int((before < p).sum()), 1) if p < 1 else len(z)
    n = min(len(z) if k <= 0 else min(k, len(z)), n_p)
    return z >= z[order[n - 1]], (np.abs(before - p).min() if p < 1 else np.inf)


@pytest.mark.strict_ranks
def test_partial_nucleus_is_exact_and_skips_the_sort_when_the_head_reaches_p():
    """A vocabulary past PARTIAL_TOP_K: peaked rows (the nucleus ends inside the 256 largest logits)
    take the partial top-k, flat rows (it does not) the full sort; both give NumPy's kept set, the
    engine's per-row form (arrays) and the trainer's (Python numbers) give the same logits bit for
    bit, and the partial threshold equals the full-sort one wherever it says it is exact."""
    from tmax_jax.rl.logprobs import PARTIAL_TOP_K, _partial_threshold, truncate

    rng = np.random.default_rng(7)
    V, S = 4096, 8
    peaked = rng.normal(size=(S, V)) * 6.0  # a few dominant tokens: >99.9% of the mass in the top 256
    flat = rng.normal(size=(S, V)) * 0.3  # mass spread over thousands of tokens
    for k, p in [(0, 0.9), (0, 0.5), (10, 0.9), (300, 0.95), (300, 1.0), (40, 1.0)]:
        for name, z in (("peaked", peaked), ("flat", flat)):
            z32 = jnp.asarray(z, jnp.float32)
            k_S, p_S = jnp.full((S,), k, jnp.int32), jnp.full((S,), p, jnp.float32)
            thr_partial, exact = _partial_threshold(z32, k_S, p_S)
            thr_full = truncation_threshold(z32, k_S, p_S)
            want_exact = (p < 1 and name == "peaked") or (p >= 1 and k <= PARTIAL_TOP_K)
            assert bool(exact) == want_exact, (k, p, name)
            if want_exact:
                np.testing.assert_array_equal(np.asarray(thr_partial), np.asarray(thr_full))
            engine = np.asarray(truncate(z32, k_S, p_S))
            trainer = np.asarray(truncate(z32, k, p))
            np.testing.assert_array_equal(engine, trainer)
            for row in range(S):
                kept, margin = np_kept(np.asarray(z32[row]), k, p)
                if margin > 1e-5:
                    np.testing.assert_array_equal(np.isfinite(engine[row]), kept, err_msg=f"{k} {p} {name}")
    # One flat row among peaked ones sends the whole batch to the sort, with the same answer.
    mixed = jnp.asarray(np.concatenate([peaked[:7], flat[:1]]), jnp.float32)
    p_S = jnp.full((S,), 0.9, jnp.float32)
    assert not bool(_partial_threshold(mixed, jnp.zeros((S,), jnp.int32), p_S)[1])
    np.testing.assert_array_equal(
        np.asarray(truncate(mixed, jnp.zeros((S,), jnp.int32), p_S)),
        np.asarray(truncate(jnp.asarray(np.concatenate([peaked[:7], flat[:1]]), jnp.float32), 0, 0.9)),
    )
