"""Engine interface and orchestrator: JetStream-style calls, continuous batching, sessions that reuse
the prefix state, weight updates without recompiles, cancellation, backpressure, stop strings."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import make_tiny_hf_checkpoint, train_tiny_tokenizer

from tmax_jax.checkpoints import load_hf
from tmax_jax.engine import (
    Engine,
    EngineBusy,
    Orchestrator,
    Request,
    ResultTokens,
    SamplingParams,
)
from tmax_jax.errors import ConfigError, TmaxError
from tmax_jax.rl.logprobs import token_logprobs

SLOTS, MAX_LEN, MAX_PREFILL = 4, 128, 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_hf(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("engine_batching"), seed=5))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=512)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    # max_prefill_length 16: prompts past 16 tokens are prefilled in chunks on top of the cache.
    return Engine(
        model,
        max_concurrent_decodes=SLOTS,
        max_cache_length=MAX_LEN,
        max_prefill_length=MAX_PREFILL,
        tokenizer=tokenizer,
    )


@pytest.fixture(scope="module")
def orch(engine):
    with Orchestrator(engine) as o:
        yield o


def rand_prompt(rng, n):
    return rng.integers(0, 256, size=n).tolist()


def trainer_logprobs(model, prompt, tokens, temperature, top_k=0):
    """Teacher-forced logprobs of ``tokens`` after ``prompt`` (jitted, right-padded to 128), under
    the request's top-k truncation as the engine reports it.

    Greedy (T == 0) tokens carry the plain logits' logprob, i.e. the trainer's T == 1, untruncated."""
    top_k = top_k if temperature else 0
    temperature = temperature or 1.0
    row = list(prompt) + list(tokens)
    seq = np.zeros((1, MAX_LEN), np.int32)
    seg = np.zeros((1, MAX_LEN), np.int32)
    seq[0, : len(row)], seg[0, : len(row)] = row, 1
    lp = _trainer_fn(model, top_k)(
        nnx.state(model), jnp.asarray(seq), jnp.asarray(seg), jnp.float32(temperature)
    )
    return np.asarray(lp)[0, len(prompt) - 1 : len(row) - 1]


_FNS = {}


def _trainer_fn(model, top_k=0):
    graphdef = nnx.graphdef(model)
    if (graphdef, top_k) not in _FNS:

        @jax.jit
        def run(state, seq, seg, temperature):
            m = nnx.merge(graphdef, state)
            hidden = m.hidden_states(seq, segment_ids=seg)
            head = m.lm_head_weight()
            return token_logprobs(hidden[:, :-1], head, seq[:, 1:], temperature=temperature, top_k=top_k)

        _FNS[(graphdef, top_k)] = run
    return _FNS[(graphdef, top_k)]


def test_jetstream_interface_calls(engine):
    assert engine.max_concurrent_decodes == SLOTS and engine.samples_per_slot == 1
    assert engine.max_prefill_length == MAX_PREFILL
    assert isinstance(engine.mesh, jax.sharding.Mesh)
    params = engine.load_params()
    state = engine.init_decode_state()
    prompt = [5, 17, 99, 3, 250, 42, 8]
    padded = np.zeros((MAX_PREFILL,), np.int32)
    padded[: len(prompt)] = prompt
    prefix, first = engine.prefill(params=params, padded_tokens=jnp.asarray(padded), true_length=len(prompt))
    assert isinstance(first, ResultTokens) and first.data.shape == (1, 3)
    s0 = first.convert_to_numpy().get_result_at_slot(0)
    assert s0.valid[0, 0] == 1 and s0.lengths[0] == 1
    tokens = [int(s0.tokens[0, 0])]
    state = engine.bulk_insert(prefix, state, [2])
    for step in range(5):
        state, res = engine.generate(params, state)
        res.copy_to_host_async()
        res = res.convert_to_numpy()
        assert res.data.shape == (SLOTS, 3)
        assert [int(res.get_result_at_slot(s).valid[0, 0]) for s in range(SLOTS)] == [0, 0, 1, 0]
        slot = res.get_result_at_slot(2)
        assert slot.lengths[0] == step + 2
        tokens.append(int(slot.tokens[0, 0]))
    # Same request through the orchestrator (greedy by default in both).
    with Orchestrator(engine) as o:
        out = o.submit(
            Request(prompt=prompt, max_tokens=6, sampling=SamplingParams(temperature=0.0))
        ).result()
    assert out.tokens == tokens


def test_jetstream_driver_flow_with_built_tokenizer(engine, tokenizer):
    """The calls JetStream's driver makes, in its order, with the tokenizer built by the engine."""
    tok = engine.build_tokenizer(engine.get_tokenizer())
    text_ids = tokenizer.encode("ls -la /tmp", add_special_tokens=False)
    enc, n = tok.encode("ls -la /tmp", is_bos=False, max_prefill_length=engine.max_prefill_length)
    assert n == len(text_ids) and enc[:n].tolist() == text_ids and enc.shape[0] == 1 << (n - 1).bit_length()
    # The tiny model's vocabulary (256) is smaller than the tokenizer's: pad raw ids for the run.
    padded, true_length = tok.pad([5, 17, 99, 3, 250, 42, 8], is_bos=False, max_prefill_length=16)
    assert padded.shape == (8,) and true_length == 7
    params = engine.load_params()
    decode_state = engine.init_decode_state()
    prefix, first = engine.prefill(params=params, padded_tokens=padded, true_length=true_length)
    tokens = [int(first.convert_to_numpy().get_result_at_slot(0).tokens[0, 0])]
    decode_state = engine.insert(prefix, decode_state, slot=1)
    engine.free_resource(0)
    while len(tokens) < 8:
        decode_state, result = engine.generate(params, decode_state)
        slot = result.convert_to_numpy().get_result_at_slot(1)
        if slot.valid[0, 0]:
            tokens.append(int(slot.tokens[0, 0]))
    ours = Orchestrator(engine)
    try:
        greedy = SamplingParams(temperature=0.0)  # the engine's default when JetStream passes none
        ref = ours.submit(
            Request(prompt=padded[:true_length].tolist(), max_tokens=8, sampling=greedy)
        ).result()
    finally:
        ours.stop()
    assert tokens == ref.tokens
    assert tok.decode(tokens) == tokenizer.decode(tokens)


def test_continuous_batching_equals_one_at_a_time(model, engine, orch):
    rng = np.random.default_rng(0)
    reqs = [
        Request(
            prompt=rand_prompt(rng, int(rng.integers(2, 40))),
            max_tokens=int(rng.integers(2, 14)),
            sampling=SamplingParams(
                temperature=float(rng.choice([0.0, 0.8, 1.0])), seed=i, top_k=int(i % 3) * 20
            ),
        )
        for i in range(11)
    ]
    steps0 = orch.steps
    together = orch.generate(reqs)
    batched_steps = orch.steps - steps0
    alone = [orch.submit(r).result() for r in reqs]
    for a, b, r in zip(together, alone, reqs):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert len(a.tokens) == r.max_tokens and a.finish_reason == "length"
        # Independent check of every slot's state (chunked prefill, reused slots): the trainer's recompute.
        np.testing.assert_allclose(
            a.logprobs,
            trainer_logprobs(model, r.prompt, a.tokens, r.sampling.temperature, r.sampling.top_k),
            atol=3e-5,
        )
    # 11 requests on 4 slots finish in far fewer steps than one at a time: freed slots were refilled.
    sequential_steps = sum(r.max_tokens - 1 for r in reqs)
    assert batched_steps < 0.5 * sequential_steps


def test_next_turn_reuses_prefix_state(model, orch):
    rng = np.random.default_rng(1)
    turn1 = rand_prompt(rng, 21)
    sp = SamplingParams(temperature=1.0, seed=3)
    a = orch.submit(Request(prompt=turn1, max_tokens=7, sampling=sp, session_id="s1")).result()
    assert a.cached_tokens == 0 and orch.num_sessions >= 1
    turn2 = turn1 + a.tokens + rand_prompt(rng, 9)
    b = orch.submit(Request(prompt=turn2, max_tokens=8, sampling=sp, session_id="s1")).result()
    # Everything but turn 1's last sampled token was already in the cache.
    assert b.cached_tokens == len(turn1) + len(a.tokens) - 1
    full = orch.submit(Request(prompt=turn2, max_tokens=8, sampling=sp)).result()
    assert full.cached_tokens == 0
    assert b.tokens == full.tokens
    np.testing.assert_allclose(b.logprobs, full.logprobs, atol=2e-5)
    np.testing.assert_allclose(b.logprobs, trainer_logprobs(model, turn2, b.tokens, 1.0), atol=3e-5)
    # A third turn that does not extend the cached tokens falls back to a full prefill.
    c = orch.submit(
        Request(prompt=turn1[:5] + [1, 2, 3], max_tokens=3, sampling=sp, session_id="s1")
    ).result()
    assert c.cached_tokens == 0
    orch.close_session("s1")


def test_update_params_changes_outputs_without_recompiling(model, engine, orch):
    reqs = [
        Request(prompt=[7, 8, 9, 10 + i], max_tokens=6, sampling=SamplingParams(temperature=0.0))
        for i in range(3)
    ]
    before = orch.generate(reqs)
    traces = dict(engine.trace_counts)
    original = nnx.state(model)
    v0 = engine.version
    try:
        scaled = jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, original)
        assert engine.update_params(scaled) == v0 + 1
        compiles = []
        listener = lambda event, secs, **kw: compiles.append(event) if "backend_compile" in event else None
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            after = orch.generate(reqs)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        assert compiles == [], f"XLA compiled {len(compiles)} programs after a weight swap"
        assert any(a.tokens != b.tokens for a, b in zip(after, before))
        assert all(v == v0 + 1 for a in after for v in a.versions)
        assert dict(engine.trace_counts) == traces, "a weight swap recompiled something"
        bad = jax.tree.map(lambda x: x[..., :1] if x.ndim >= 2 else x, original)
        with pytest.raises(ConfigError, match="expected"):
            engine.update_params(bad)
    finally:
        engine.update_params(original)
    again = orch.generate(reqs)
    assert [a.tokens for a in again] == [b.tokens for b in before]


def test_in_flight_update_is_recorded_per_token(model, engine, orch):
    original = nnx.state(model)
    v0 = engine.version
    h = orch.submit(Request(prompt=[1, 2, 3], max_tokens=60, sampling=SamplingParams(temperature=1.0)))
    for i, _ in enumerate(h):
        if i == 3:
            engine.update_params(original)  # same weights, new version
    out = h.result()
    assert out.versions[0] == v0 and out.versions[-1] == v0 + 1
    assert out.versions == sorted(out.versions)


def test_cancel_frees_the_slot(orch):
    h = orch.submit(Request(prompt=[4, 5, 6], max_tokens=100, sampling=SamplingParams(temperature=1.0)))
    for i, _ in enumerate(h):
        if i == 2:
            h.cancel()
    out = h.result()
    assert out.finish_reason == "cancelled" and 3 <= len(out.tokens) < 100
    ok = orch.submit(Request(prompt=[4, 5, 6], max_tokens=4)).result()
    assert ok.finish_reason == "length" and len(ok.tokens) == 4


def test_stop_finishes_every_request_even_the_one_being_prefilled(model):
    # A fresh engine of new shapes compiles its first prefill: stop() lands in the middle of it.
    eng = Engine(model, max_concurrent_decodes=2, max_cache_length=MAX_LEN, max_prefill_length=8)
    o = Orchestrator(eng)
    handles = [o.submit(Request(prompt=[7, 8, 9 + i], max_tokens=50)) for i in range(4)]
    time.sleep(0.2)
    o.stop()
    # A waiter (an agent's episode) must never block on a request the stopped orchestrator dropped.
    assert [h.result(timeout=60).finish_reason for h in handles] == ["cancelled"] * 4
    with pytest.raises(TmaxError, match="stopped"):
        o.submit(Request(prompt=[1, 2], max_tokens=2))


def test_backpressure_raises_engine_busy(engine):
    with Orchestrator(engine, max_queued=1) as o:
        handles, busy = [], 0
        for i in range(40):
            try:
                handles.append(o.submit(Request(prompt=[i % 200 + 1, 2], max_tokens=3), block=False))
            except EngineBusy:
                busy += 1
        assert busy > 0
        assert all(h.result().finish_reason == "length" for h in handles)


def test_stop_strings_end_the_request(engine, orch, tokenizer):
    prompt = [10, 20, 30, 40, 50]
    free = orch.submit(Request(prompt=prompt, max_tokens=20)).result()
    text = tokenizer.decode(free.tokens)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "pick a prompt whose reply has visible text"
    out = orch.submit(Request(prompt=prompt, max_tokens=20, stop=[stop])).result()
    assert out.finish_reason == "stop" and out.stop_string == stop
    n = len(out.tokens)
    assert out.tokens == free.tokens[:n] and stop in tokenizer.decode(out.tokens)
    assert stop not in tokenizer.decode(out.tokens[:-1])


@pytest.mark.parametrize(
    "req,msg",
    [
        (Request(prompt=[]), "empty"),
        (Request(prompt=[1, 999]), r"\[0, 256\)"),
        (Request(prompt=list(range(MAX_LEN))), "max_cache_length"),
        (Request(prompt=[1], max_tokens=0), "max_tokens"),
        (Request(prompt=[1], stop_token_ids=[300]), "stop token"),
        (Request(prompt=[1], stop="x"), "list of non-empty strings"),
    ],
)
def test_bad_requests_are_rejected_with_a_reason(orch, req, msg):
    with pytest.raises(ConfigError, match=msg):
        orch.submit(req)


def test_bad_engine_config_is_named(model):
    with pytest.raises(ConfigError, match="max_prefill_length"):
        Engine(model, max_cache_length=32, max_prefill_length=64)
    with pytest.raises(ConfigError, match="max_concurrent_decodes"):
        Engine(model, max_concurrent_decodes=0)


def test_generate_thread_survives_many_threads_submitting(orch):
    results = {}

    def worker(i):
        results[i] = orch.submit(Request(prompt=[i + 1, 2, 3], max_tokens=5)).result()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(8))
    assert all(len(r.tokens) == 5 for r in results.values())


def test_engine_policy_runs_turns_on_cached_state(model, orch):
    from tmax_jax.engine.session import EnginePolicy

    rng = np.random.default_rng(2)
    with EnginePolicy(orch, sampling=SamplingParams(temperature=1.0, seed=8)) as policy:
        first = rand_prompt(rng, 12)
        g1 = policy(first, max_new_tokens=5)
        second = rand_prompt(rng, 6)
        g2 = policy(second, max_new_tokens=5)
        assert policy.cached_tokens == [0, len(first) + len(g1.tokens) - 1]
        assert g1.versions and g2.finish_reason == "length"
        context = first + g1.tokens + second
        np.testing.assert_allclose(g2.logprobs, trainer_logprobs(model, context, g2.tokens, 1.0), atol=3e-5)
    assert policy.session_id not in orch._sessions
