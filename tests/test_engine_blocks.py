"""Decode blocks, live-length attention, batched prefill and forked groups against the one-step,
full-length, one-request-at-a-time engine and the trainer's teacher-forced logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import make_tiny_hf_checkpoint

from tmax_jax.checkpoints import load_hf
from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams
from tmax_jax.engine.engine import PeriodParams, PrefillRequest
from tmax_jax.errors import ConfigError
from tmax_jax.rl.logprobs import token_logprobs

SLOTS, MAX_LEN, STEPS = 4, 128, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_hf(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("engine_blocks"), seed=7))


@pytest.fixture(scope="module")
def engine(model):
    # min_attend_bucket 32: blocks attend over 32 or 64 keys of the 128-long cache.
    return Engine(
        model,
        max_concurrent_decodes=SLOTS,
        max_cache_length=MAX_LEN,
        max_prefill_length=16,
        decode_steps=STEPS,
        min_attend_bucket=32,
        max_prefill_batch=4,
    )


_TRAINER = {}


def trainer_logprobs(model, prompt, tokens, temperature, top_k=0, top_p=1.0):
    """Teacher-forced logprobs of ``tokens`` after ``prompt``: one jitted full forward, as the trainer
    (under the slot's top-k/top-p truncation, which the engine's logprobs report)."""
    row = list(prompt) + list(tokens)
    seq = np.zeros((1, MAX_LEN), np.int32)
    seg = np.zeros((1, MAX_LEN), np.int32)
    seq[0, : len(row)], seg[0, : len(row)] = row, 1
    graphdef, state = nnx.split(model)
    key = (graphdef, top_k, top_p)
    if key not in _TRAINER:

        @jax.jit
        def run(state, seq, seg, t):
            m = nnx.merge(graphdef, state)
            hidden = m.hidden_states(seq, segment_ids=seg)
            head = m.lm_head_weight()
            return token_logprobs(hidden[:, :-1], head, seq[:, 1:], temperature=t, top_k=top_k, top_p=top_p)

        _TRAINER[key] = run
    lp = _TRAINER[key](state, jnp.asarray(seq), jnp.asarray(seg), jnp.float32(temperature or 1.0))
    return np.asarray(lp)[0, len(prompt) - 1 : len(row) - 1]


REQS = [
    # (prompt length, sampling, max_tokens, stop ids)
    (5, SamplingParams(temperature=0.0), 40, None),
    (14, SamplingParams(temperature=1.0, seed=3), 9, None),  # ends by length mid-block
    (11, SamplingParams(temperature=0.8, top_k=7, seed=4), 30, None),
    (16, SamplingParams(temperature=1.0, top_p=0.9, seed=5), 30, None),
]


def _prefill_all(engine, prompts, stops=None):
    params = engine.params
    reqs = [
        PrefillRequest(p, sp, mt, None if stops is None else stops[i])
        for i, (p, (_, sp, mt, _)) in enumerate(zip(prompts, REQS))
    ]
    return engine.prefill_many(params, reqs)


def _one_step_run(engine, prefixes, steps):
    state = engine.init_decode_state()
    for s, p in enumerate(prefixes):
        state = engine.insert(p, state, s)
    toks, valid, lps = [], [], []
    for _ in range(steps):
        state, res = engine.generate(engine.params, state)
        r = res.convert_to_numpy()
        toks.append(r.data[:, 0])
        valid.append(r.data[:, 1].astype(bool))
        lps.append(r.log_prob[:, 0])
    return np.array(toks), np.array(valid), np.array(lps)


def _block_run(engine, prefixes, steps, prompt_lens):
    state = engine.init_decode_state()
    for s, p in enumerate(prefixes):
        state = engine.insert(p, state, s)
    toks, valid, lps = [], [], []
    done = 0
    sizes = [1, 3, STEPS, 2]  # uneven blocks, some shorter than decode_steps
    i = 0
    while done < steps:
        k = min(sizes[i % len(sizes)], steps - done)
        longest = max(prompt_lens) + done  # every slot holds its prompt + generated - 1 + 1 fed
        state, blk = engine.generate_block(engine.params, state, k, longest if i % 2 else None)
        t, v, lp = jax.device_get((blk.tokens, blk.valid, blk.log_prob))
        assert not v[k:].any(), "rows past the requested steps must not be valid"
        toks.extend(t[:k])
        valid.extend(v[:k])
        lps.extend(lp[:k])
        done += k
        i += 1
    return np.array(toks), np.array(valid), np.array(lps)


def test_blocks_match_single_steps_token_for_token(model, engine):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=n).tolist() for n, *_ in REQS]
    steps = 26  # the longest slot reaches 42 tokens: blocks attend over 32, then 64 keys
    ref = _one_step_run(engine, _prefill_all(engine, prompts), steps)
    firsts = _prefill_all(engine, prompts)
    got = _block_run(engine, firsts, steps, [len(p) for p in prompts])
    np.testing.assert_array_equal(got[1], ref[1])  # the same steps valid (stops are exact)
    np.testing.assert_array_equal(np.where(ref[1], got[0], -1), np.where(ref[1], ref[0], -1))
    np.testing.assert_allclose(got[2][ref[1]], ref[2][ref[1]], atol=1e-6, rtol=0)
    # Slot 1 ends by max_tokens (its 9th token, 8 decode steps) in the middle of a block.
    assert ref[1][:, 1].sum() == 8 and not ref[1][8:, 1].any()
    # The blocks attended over live-length buckets; the reference, the whole cache. Both against the
    # trainer's teacher-forced recompute of each slot's tokens.
    for s, (p, (_, sp, _, _)) in enumerate(zip(prompts, REQS)):
        first = firsts[s]
        tokens = [int(first.token[0])] + got[0][got[1][:, s], s].tolist()
        lps = [float(first.log_prob[0])] + got[2][got[1][:, s], s].tolist()
        want = trainer_logprobs(model, p, tokens, sp.temperature, sp.top_k or 0, sp.top_p or 1.0)
        np.testing.assert_allclose(lps, want, atol=3e-5, err_msg=f"slot {s}")


def test_block_stops_on_a_stop_token_and_emits_nothing_after(engine):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, size=n).tolist() for n, *_ in REQS]
    free = _one_step_run(engine, _prefill_all(engine, prompts), 12)
    stop = int(free[0][5, 0])  # slot 0's 7th token (greedy)
    cut = int(np.flatnonzero(free[0][:, 0] == stop)[0])
    stops = [[stop], None, None, None]
    got = _block_run(engine, _prefill_all(engine, prompts, stops), 12, [len(p) for p in prompts])
    assert got[1][: cut + 1, 0].all() and not got[1][cut + 1 :, 0].any()
    np.testing.assert_array_equal(got[0][: cut + 1, 0], free[0][: cut + 1, 0])


def test_group_fork_equals_independent_prefills(model, engine):
    """12 samples of one prompt: one prefill row, each sample exactly what it is alone."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 256, size=15).tolist()
    reqs = [
        Request(prompt=prompt, max_tokens=6, sampling=SamplingParams(temperature=1.0, seed=100 + i))
        for i in range(12)
    ]
    engine.prefill_counts.clear()
    with Orchestrator(engine) as orch:
        group = orch.generate(reqs)
    # The prefill thread may take the first request before the rest arrive; the prompt cache
    # serves every later one.
    assert engine.prefill_counts["rows"] == 1 and engine.prefill_counts["forked"] == len(reqs) - 1
    engine.prefill_counts.clear()
    alone = []
    with Orchestrator(engine) as orch:
        for r in reqs:
            engine.update_params(engine.params)  # a new version: the prompt cache is emptied
            alone.append(orch.submit(r).result())
    assert engine.prefill_counts["rows"] == len(reqs) and engine.prefill_counts["forked"] == 0
    assert len({tuple(g.tokens) for g in group}) > 3, "samples should differ"
    for g, a in zip(group, alone):
        assert g.tokens == a.tokens
        np.testing.assert_allclose(g.logprobs, a.logprobs, atol=1e-6, rtol=0)
    np.testing.assert_allclose(
        group[0].logprobs, trainer_logprobs(model, prompt, group[0].tokens, 1.0), atol=3e-5
    )


def test_forked_cache_is_the_independent_prefill(engine):
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 256, size=13).tolist(), rng.integers(0, 256, size=9).tolist()
    sp = SamplingParams(temperature=1.0, seed=1)
    reqs = [PrefillRequest(a, sp), PrefillRequest(b, sp), PrefillRequest(a, SamplingParams(seed=2))]
    engine.update_params(engine.params)  # a new version empties the prompt cache
    engine.prefill_counts.clear()
    batched = engine.prefill_many(engine.params, reqs)
    assert engine.prefill_counts["rows"] == 2 and engine.prefill_counts["calls"] == 1
    assert batched[0].cache is batched[2].cache  # forked, not prefilled again
    for p, prompt in zip(batched, [a, b, a]):
        engine.update_params(engine.params)
        (ref,) = engine.prefill_many(engine.params, [PrefillRequest(prompt, sp)])
        assert p.length == ref.length == len(prompt)
        for x, y in zip(jax.tree.leaves(p.cache), jax.tree.leaves(ref.cache)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)


def test_session_turn_after_a_stop_string_reuses_an_exact_cache(model, engine):
    """A session request with stop strings decodes one step per block, so the cache saved for its
    next turn holds exactly the emitted tokens."""

    class Chars:
        def decode(self, ids):
            return "".join(chr(97 + t % 26) for t in ids)

    eng = Engine(
        model, max_concurrent_decodes=2, max_cache_length=MAX_LEN, max_prefill_length=32, decode_steps=4
    )
    tok = Chars()
    with Orchestrator(eng, tokenizer=tok) as orch:
        prompt = list(range(40, 52))
        sp = SamplingParams(temperature=1.0, seed=9)
        free = orch.submit(Request(prompt=prompt, max_tokens=12, sampling=sp)).result()
        stop = tok.decode(free.tokens[5:7])
        a = orch.submit(
            Request(prompt=prompt, max_tokens=12, sampling=sp, stop=[stop], session_id="x")
        ).result()
        assert a.finish_reason == "stop" and a.tokens == free.tokens[: len(a.tokens)]
        turn2 = prompt + a.tokens + [3, 4, 5]
        b = orch.submit(Request(prompt=turn2, max_tokens=5, sampling=sp, session_id="x")).result()
        full = orch.submit(Request(prompt=turn2, max_tokens=5, sampling=sp)).result()
    assert b.cached_tokens == len(prompt) + len(a.tokens) - 1
    assert b.tokens == full.tokens
    np.testing.assert_allclose(b.logprobs, trainer_logprobs(model, turn2, b.tokens, 1.0), atol=3e-5)


def test_bad_block_arguments_are_named(model, engine):
    state = engine.init_decode_state()
    with pytest.raises(ConfigError, match="decode_steps"):
        engine.generate_block(engine.params, state, STEPS + 1)
    with pytest.raises(ConfigError, match="decode_steps"):
        Engine(model, decode_steps=0)
    with pytest.raises(ConfigError, match="prompt_cache_entries"):
        Engine(model, prompt_cache_entries=-1)


def test_unrolled_periods_match_the_scanned_stack_and_the_trainer(tmp_path):
    """Two layer periods: the engine's unrolled periods (its own per-period weights) against the same
    engine scanning the stacked weights, and both against the trainer's teacher-forced logprobs."""
    model = load_hf(make_tiny_hf_checkpoint(tmp_path, seed=3, num_hidden_layers=8))
    assert model.config.num_groups == 2
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, size=n).tolist() for n, *_ in REQS]
    reqs = [Request(prompt=p, max_tokens=12, sampling=sp) for p, (_, sp, *_) in zip(prompts, REQS)]
    outs = {}
    for unroll in (True, False):
        eng = Engine(model, max_concurrent_decodes=SLOTS, max_cache_length=MAX_LEN, max_prefill_length=16,
                     decode_steps=STEPS, unroll_periods=unroll)  # fmt: skip
        assert isinstance(eng.params, PeriodParams) == unroll
        eng.update_params(nnx.state(model))  # the model's stacked state is split again
        eng.update_params(eng.params)  # the engine's own form passes through
        with Orchestrator(eng) as orch:
            outs[unroll] = orch.generate(reqs)
    for a, b, p, (_, sp, *_) in zip(outs[True], outs[False], prompts, REQS):
        assert a.tokens == b.tokens and len(a.tokens) == 12
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
        ref = trainer_logprobs(model, p, a.tokens, sp.temperature, sp.top_k, sp.top_p)
        np.testing.assert_allclose(a.logprobs, ref, atol=2e-5, rtol=0)


def test_periods_argument_is_checked(model):
    ids = jnp.zeros((1, 3), jnp.int32)
    periods = model.unstack_periods()
    with pytest.raises(ValueError, match="with a cache only"):
        model.hidden_states(ids, periods=periods)
    with pytest.raises(ValueError, match="per-period states"):
        model.hidden_states(ids, cache=model.init_cache(1, 8), periods=periods + periods)


def test_decode_block_temporaries_stay_below_the_kv_cache(model):
    """XLA's compiled memory analysis of a decode block attending over a 2048-token cache: its
    temporaries stay below one and a half KV caches. Decode attention once padded its one query per
    slot to a 512-query flash block (about 9x the cache in scores and 512x the work), and the block
    once stacked every period's cache into a fresh copy."""
    eng = Engine(
        model, max_concurrent_decodes=8, max_cache_length=2048, max_prefill_length=16, min_attend_bucket=2048
    )
    state = eng.init_decode_state()
    block = jax.jit(eng._generate_block_impl, static_argnums=(3,), donate_argnums=(1,))
    compiled = block.lower(eng.params, state, jnp.int32(4), 2048).compile()
    kv_bytes = sum(a.nbytes for a in state.cache.k + state.cache.v)
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 1.5 * kv_bytes, (
        f"{temp / 2**20:.1f} MiB of temporaries for a {kv_bytes / 2**20:.1f} MiB KV cache"
    )


def test_batched_first_tokens_equal_one_request_at_a_time(engine):
    """prefill_many draws every request's first token in one call (padded to a power of two): exactly
    what each request draws alone."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (6, 9, 12)]
    sps = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=5, seed=-3),
        SamplingParams(temperature=1.0, top_p=0.8, seed=2**31 - 1),
    ]
    reqs = [PrefillRequest(p, sp, 20 + i, (7, 9)) for i, (p, sp) in enumerate(zip(prompts, sps))]
    engine.update_params(engine.params)
    assert engine.prefill_many(engine.params, []) == []
    batched = engine.prefill_many(engine.params, reqs)
    alone = []
    for r in reqs:
        engine.update_params(engine.params)  # no prompt-cache hit: each one prefilled alone
        alone += engine.prefill_many(engine.params, [r])
    for b, a in zip(batched, alone):
        for name in ("token", "temperature", "top_k", "top_p", "max_tokens", "stop_ids"):
            np.testing.assert_array_equal(
                np.asarray(getattr(b, name)), np.asarray(getattr(a, name)), err_msg=name
            )
        np.testing.assert_array_equal(np.asarray(b.key), np.asarray(a.key))
        np.testing.assert_allclose(np.asarray(b.log_prob), np.asarray(a.log_prob), atol=1e-6, rtol=0)
    for b, sp in zip(batched, sps):  # each key is jax.random.key(seed), made on the host
        np.testing.assert_array_equal(np.asarray(b.key), jax.random.key_data(jax.random.key(sp.seed))[None])
    # A seed past int32 takes the host path (jax.random.key of the Python int) for the whole call.
    big = SamplingParams(temperature=1.0, seed=2**40 + 5)
    engine.update_params(engine.params)
    mixed = engine.prefill_many(engine.params, [reqs[1], PrefillRequest(prompts[0], big, 5)])
    assert int(mixed[0].token[0]) == int(batched[1].token[0])
    np.testing.assert_array_equal(np.asarray(mixed[0].key), np.asarray(batched[1].key))
    np.testing.assert_array_equal(
        np.asarray(mixed[1].key), jax.random.key_data(jax.random.key(2**40 + 5))[None]
    )
    state = engine.init_decode_state()
    for slot, p in enumerate(batched):  # host-side fields and raw key data go into a slot as they are
        state = engine.insert(p, state, slot)
    np.testing.assert_array_equal(
        jax.random.key_data(state.key[:3]), np.concatenate([np.asarray(p.key) for p in alone])
    )


@pytest.mark.parametrize("unroll", [True, False])
def test_update_params_with_copy_owns_every_buffer(model, unroll):
    """``update_params(state, copy=True)``: the engine's weights share no buffer with ``state`` (which
    the caller may then donate) and hold its values, unrolled into periods or not."""
    eng = Engine(
        model, max_concurrent_decodes=2, max_cache_length=32, max_prefill_length=16, unroll_periods=unroll
    )
    state = jax.tree.map(lambda a: a + 1, nnx.state(model))  # new values, buffers of the caller's
    assert eng.update_params(state, copy=True) == 1
    ours = {a.unsafe_buffer_pointer() for a in jax.tree.leaves(state)}
    assert ours.isdisjoint(a.unsafe_buffer_pointer() for a in jax.tree.leaves(eng.params))
    held = eng.params
    if unroll:
        assert isinstance(held, PeriodParams)
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *held.periods)
        held = nnx.State(dict(held.rest)) | nnx.State({"blocks": stacked})
    want = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state)}
    got = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(held)}
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_update_params_keeps_the_weights_made_from_the_same_arrays(tmp_path):
    """``generate()`` hands the engine the model's state at every call: the same array objects keep the
    weights the engine made from them (no second split into periods), still as a new version with an
    empty prompt cache; new arrays, even equal ones, are split again, and a model whose weights changed
    generates from the new ones."""
    from tmax_jax.engine import generate
    from tmax_jax.engine.api import _ENGINES

    model = load_hf(make_tiny_hf_checkpoint(tmp_path, seed=5))
    eng = Engine(model, max_concurrent_decodes=2, max_cache_length=64, max_prefill_length=16)
    made = eng.params
    assert isinstance(made, PeriodParams)
    assert eng.update_params(nnx.state(model)) == 1
    assert eng.params is made
    assert eng.update_params(model) == 2  # the module itself: its leaves are checked first
    assert eng.params is made
    assert eng.update_params(jax.tree.map(lambda a: a + 0, nnx.state(model))) == 3
    assert eng.params is not made

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    first = generate(model, prompts, max_new_tokens=6, temperature=0.0)
    engine = next(iter(_ENGINES[model].values()))
    kept = engine.params
    again = generate(model, prompts, max_new_tokens=6, temperature=0.0)
    assert engine.params is kept
    assert [o.tokens for o in again] == [o.tokens for o in first]
    np.testing.assert_array_equal([o.logprobs for o in again], [o.logprobs for o in first])
    # New weights in the model (the head scaled): generate() reads them, the logprobs change.
    state = nnx.state(model)
    state["embed_tokens"] = jax.tree.map(lambda a: a * 3.0, state["embed_tokens"])
    nnx.update(model, state)
    changed = generate(model, prompts, max_new_tokens=6, temperature=0.0)
    assert engine.params is not kept
    assert not np.allclose(changed[0].logprobs, first[0].logprobs, atol=1e-3)
