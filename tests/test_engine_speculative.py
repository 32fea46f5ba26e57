"""Speculative decoding with Qwen 3.5's multi-token-prediction module: the module against one
composed from transformers' own layers, and the speculative engine against the plain one and the
trainer's logprobs (the emitted tokens must be the model's own, whatever the draft proposes)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers_hf import add_mtp_to_checkpoint, make_tiny_hf_checkpoint
from test_engine_blocks import trainer_logprobs

from tmax_jax.checkpoints import load_hf, load_mtp
from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams
from tmax_jax.errors import CheckpointError, ConfigError
from tmax_jax.models.qwen35.mtp import oracle_draft

KW = dict(
    max_concurrent_decodes=4,
    max_cache_length=128,
    max_prefill_length=16,
    decode_steps=4,
    min_attend_bucket=32,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("spec"), seed=3)
    torch_mtp = add_mtp_to_checkpoint(path, seed=4)
    return path, torch_mtp


def near_oracle(path, mix: float):
    """(model, mtp) from the checkpoint at ``path`` where the draft nearly knows the model
    (``oracle_draft``: right always at ``mix`` 0, part of the time above)."""
    return oracle_draft(load_hf(path), mix, load_mtp(path))


def test_mtp_module_matches_transformers_layers(ckpt):
    path, torch_mtp = ckpt
    model, mtp = load_hf(path), load_mtp(path)
    assert mtp.num_layers == 1
    rng = np.random.default_rng(0)
    B, T, D = 2, 9, model.config.hidden_size
    hidden = rng.standard_normal((B, T, D)).astype(np.float32)
    ids = rng.integers(0, model.config.vocab_size, (B, T))
    embed = np.asarray(model.embed_tokens[...])
    with torch.no_grad():
        ref = torch_mtp(torch.tensor(embed), torch.tensor(hidden), torch.tensor(ids)).numpy()
    pos = np.broadcast_to(np.arange(T), (B, T))
    out, _ = mtp(embed, hidden, ids, pos, np.ones((B, T), np.int32))
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-5)
    # With a KV cache, in two calls (the second row's first call has a pad at its end).
    k_shape, v_shape = mtp.kv_shapes(B, 32)
    kv = ((jnp.zeros(k_shape), jnp.zeros(v_shape)),)
    seg = np.ones((B, 5), np.int32)
    seg[1, 4] = 0
    first, kv = mtp(embed, hidden[:, :5], ids[:, :5], pos[:, :5], seg, kv, jnp.zeros((B,), jnp.int32))
    n = seg.sum(1)
    rest = [hidden[b, n[b] :] for b in range(B)]
    width = max(len(r) for r in rest)
    h2 = np.zeros((B, width, D), np.float32)
    i2 = np.zeros((B, width), np.int64)
    s2 = np.zeros((B, width), np.int32)
    for b in range(B):
        h2[b, : len(rest[b])], i2[b, : len(rest[b])], s2[b, : len(rest[b])] = rest[b], ids[b, n[b] :], 1
    second, _ = mtp(embed, h2, i2, n[:, None] + np.arange(width)[None], s2, kv, jnp.asarray(n))
    np.testing.assert_allclose(np.asarray(first)[0], ref[0, :5], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(first)[1, :4], ref[1, :4], atol=2e-5, rtol=1e-5)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(second)[b, : T - n[b]], ref[b, n[b] :], atol=2e-5, rtol=1e-5)


def test_load_mtp_needs_every_tensor(ckpt, tmp_path):
    plain = make_tiny_hf_checkpoint(tmp_path, seed=1)
    assert load_mtp(plain) is None
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(ckpt[0] / "mtp.safetensors"))
    del tensors["mtp.layers.0.self_attn.k_norm.weight"]
    save_file(tensors, str(plain / "mtp.safetensors"))
    with pytest.raises(CheckpointError, match="k_norm"):
        load_mtp(plain)


def _run(engine, prompts, temperature, max_tokens=20, stop=None):
    with Orchestrator(engine) as orch:
        reqs = [
            Request(
                prompt=p,
                max_tokens=max_tokens,
                sampling=SamplingParams(temperature=temperature, seed=10 + i),
                stop_token_ids=stop,
            )
            for i, p in enumerate(prompts)
        ]
        outs = orch.generate(reqs)
        slot_steps, tokens = orch.take_decode_counts()
    # Every token after a request's first (which its prefill samples) came from a decode step.
    assert tokens == sum(len(c.tokens) - 1 for c in outs)
    assert slot_steps <= tokens <= slot_steps * engine.tokens_per_step
    return outs, orch.steps


PROMPTS = [list(np.random.default_rng(1).integers(0, 256, n)) for n in (5, 9, 20, 3, 12)]


@pytest.mark.parametrize("temperature,k,mix", [(0.0, 2, 0.3), (1.0, 1, 0.3), (1.0, 3, 0.0), (0.0, 3, 1.0)])
def test_speculative_engine_emits_the_models_tokens(ckpt, temperature, k, mix):
    """Greedy and sampled, with drafts that are right all, part or (random module, greedy) almost none
    of the time: the same tokens as the plain engine, logprobs within float rounding of it and of
    the trainer's teacher-forced ones; with right drafts, fewer model steps."""
    model, mtp = near_oracle(ckpt[0], mix) if mix < 1 else (load_hf(ckpt[0]), load_mtp(ckpt[0]))
    prompts = [[int(t) for t in p] for p in PROMPTS]
    plain, plain_steps = _run(Engine(model, **KW), prompts, temperature)
    spec, spec_steps = _run(Engine(model, mtp=mtp, speculative_tokens=k, **KW), prompts, temperature)
    for a, b, p in zip(plain, spec, prompts):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-5)
        np.testing.assert_allclose(b.logprobs, trainer_logprobs(model, p, b.tokens, temperature), atol=3e-5)
    if mix < 1:
        assert spec_steps < plain_steps * (0.75 if mix == 0 else 0.95)


def test_speculative_stops_where_the_plain_engine_stops(ckpt):
    model, mtp = near_oracle(ckpt[0], 0.0)
    prompts = [[int(t) for t in p] for p in PROMPTS[:3]]
    spec = Engine(model, mtp=mtp, speculative_tokens=3, **KW)
    plain = Engine(model, **KW)
    # max_tokens inside a step's accepted run
    a, _ = _run(plain, prompts, 0.0, max_tokens=6)
    b, _ = _run(spec, prompts, 0.0, max_tokens=6)
    assert [c.tokens for c in b] == [c.tokens for c in a] and all(len(c.tokens) == 6 for c in b)
    # a stop token inside an accepted run: the first row's fifth token
    stop = [a[0].tokens[4]]
    a, _ = _run(plain, prompts, 0.0, stop=stop)
    b, _ = _run(spec, prompts, 0.0, stop=stop)
    assert [c.tokens for c in b] == [c.tokens for c in a]
    assert b[0].finish_reason == "stop" and b[0].tokens[-1] == stop[0]


def test_speculative_session_turns_continue_an_exact_cache(ckpt):
    """A session's next turn prefills on the cache its speculative turn left: the same tokens and
    logprobs as a fresh prefill of the whole conversation."""
    model, mtp = near_oracle(ckpt[0], 0.3)
    eng = Engine(model, mtp=mtp, speculative_tokens=2, **KW)
    sp = SamplingParams(temperature=1.0, seed=5)
    prompt = [int(t) for t in PROMPTS[2]]
    with Orchestrator(eng) as orch:
        a = orch.submit(Request(prompt=prompt, max_tokens=9, sampling=sp, session_id="s")).result()
        turn2 = prompt + a.tokens + [7, 8, 9]
        orch.take_decode_counts()
        b = orch.submit(Request(prompt=turn2, max_tokens=24, sampling=sp, session_id="s")).result()
        session_counts = orch.take_decode_counts()
        fresh = orch.submit(Request(prompt=turn2, max_tokens=24, sampling=sp)).result()
        fresh_counts = orch.take_decode_counts()
    assert b.cached_tokens == len(prompt) + len(a.tokens) - 1
    assert b.tokens == fresh.tokens
    # The draft continues as well as after a fresh prefill (its KV past the live tokens once held
    # NaN after a continuation, which killed every later draft of the slot).
    assert session_counts == fresh_counts and fresh_counts[1] > fresh_counts[0], (
        session_counts,
        fresh_counts,
    )
    np.testing.assert_allclose(b.logprobs, trainer_logprobs(model, turn2, b.tokens, 1.0), atol=3e-5)


def test_speculative_settings_are_checked(ckpt):
    model, mtp = load_hf(ckpt[0]), load_mtp(ckpt[0])
    with pytest.raises(ConfigError, match="mtp=load_mtp"):
        Engine(model, speculative_tokens=2)
    with pytest.raises(ConfigError, match="speculative_tokens"):
        Engine(model, mtp=mtp, speculative_tokens=-1)
    with pytest.raises(ConfigError, match="unroll_periods"):
        Engine(model, mtp=mtp, speculative_tokens=1, unroll_periods=False)
    eng = Engine(model, mtp=mtp, speculative_tokens=1, **KW)
    with pytest.raises(ConfigError, match="generate_block"):
        eng.generate(eng.params, eng.init_decode_state())


def test_speculative_options_name_what_is_wrong(ckpt, tmp_path):
    """The options that turn speculation on (train's engine.speculative_tokens, serve's and eval's
    --speculative-tokens) share one check: a count that is not an integer >= 0, a checkpoint without
    mtp.* tensors and MoE routing replay are errors that name the option."""
    from tmax_jax.engine.api import speculative_settings
    from tmax_jax.train.config import load_train_config
    from tmax_jax.train.mtp_fit import draft_settings

    plain = make_tiny_hf_checkpoint(tmp_path / "plain", seed=3)
    assert speculative_settings(plain, 0) == {}
    with pytest.raises(ConfigError, match=r"--speculative-tokens=2 .* holds no mtp\.\* tensors"):
        speculative_settings(plain, 2, setting="--speculative-tokens")
    with pytest.raises(ConfigError, match="--speculative-tokens must be an integer >= 0"):
        speculative_settings(ckpt[0], -1, setting="--speculative-tokens")
    got = speculative_settings(ckpt[0], 2)
    assert got["speculative_tokens"] == 2 and got["mtp"].num_layers == 1

    with pytest.raises(ConfigError, match="engine.speculative_tokens must be an integer >= 0"):
        load_train_config(None, {"engine": {"speculative_tokens": -1}})
    with pytest.raises(ConfigError, match="set engine.speculative_tokens"):
        load_train_config(None, {"engine": {"draft_fit_steps": 5}})
    with pytest.raises(ConfigError, match="engine.draft_fit_learning_rate must be > 0"):
        load_train_config(
            None, {"engine": {"speculative_tokens": 1, "draft_fit_steps": 5, "draft_fit_learning_rate": 0}}
        )
    cfg = load_train_config(None, {"engine": {"speculative_tokens": 3}})
    with pytest.raises(ConfigError, match=r"engine.speculative_tokens=3 .* holds no mtp"):
        draft_settings(cfg, plain, None)
    assert draft_settings(cfg, ckpt[0], None)["speculative_tokens"] == 3
    # Fitting the draft after every step starts a new module where the checkpoint has none.
    fit = load_train_config(None, {"engine": {"speculative_tokens": 2, "draft_fit_steps": 3}})
    fresh = draft_settings(fit, plain, None)["mtp"]
    assert fresh.num_layers == 1 and fresh.config.hidden_size == load_hf(plain).config.hidden_size
    replay = load_train_config(
        None, {"engine": {"speculative_tokens": 1}, "rl": {"train_step": {"routing_replay": True}}}
    )
    with pytest.raises(ConfigError, match="routing_replay"):
        draft_settings(replay, ckpt[0], None)


def test_generate_function_with_a_draft(ckpt):
    """``tmax_jax.engine.generate(..., mtp=, speculative_tokens=)``: the plain call's tokens, with
    fewer model steps when the draft is right; the engine it keeps is a speculative one."""
    from tmax_jax.engine import generate
    from tmax_jax.engine.api import _ENGINES

    model, mtp = near_oracle(ckpt[0], 0.0)
    prompts = [[int(t) for t in p] for p in PROMPTS]
    kw = dict(max_new_tokens=10, temperature=1.0, seed=4, eos_token_id=[])
    plain = generate(model, prompts, **kw)
    spec = generate(model, prompts, mtp=mtp, speculative_tokens=3, **kw)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    for a, b in zip(plain, spec):
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-5)
    assert sorted(e.tokens_per_step for e in _ENGINES[model].values()) == [1, 4]


@pytest.mark.parametrize("shard", ["5GB", "30KB"])
def test_save_hf_writes_the_mtp_tensors(ckpt, tmp_path, shard):
    """``save_hf(model, mtp=)`` writes the module as the checkpoint's ``mtp.*`` tensors (indexed when
    sharded): the same values the torch module wrote, read back by load_mtp, while transformers loads
    the directory as before."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from tmax_jax.checkpoints import save_hf

    path, torch_mtp = ckpt
    model, mtp = load_hf(path), load_mtp(path)
    out = save_hf(model, tmp_path / "out", mtp=mtp, max_shard_size=shard)
    written = {}
    for f in out.glob("*.safetensors"):
        written.update(load_file(str(f)))
    expected = {k: v.numpy() for k, v in torch_mtp.mtp_state_dict().items()}
    assert expected and set(expected) <= set(written)
    for name, value in expected.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    if shard == "30KB":
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(expected) <= set(index)
    again = load_mtp(out)
    for a, b in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(mtp))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype="float32").eval()
    ids = torch.tensor([[5, 9, 2, 7, 1]])
    with torch.no_grad():
        logits = hf(ids).logits.numpy()
    np.testing.assert_allclose(logits, np.asarray(model(jnp.asarray(ids.numpy()))), atol=2e-5)


def test_speculative_group_samples_of_one_prompt(ckpt):
    """A GRPO group (several samples of one prompt, prefilled once and forked into their slots, the
    draft's state with them) and a repeated prompt from the prompt cache: the plain engine's tokens."""
    model, mtp = near_oracle(ckpt[0], 0.3)
    prompt = [int(t) for t in PROMPTS[1]]
    reqs = [
        Request(prompt=prompt, max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=20 + i))
        for i in range(6)
    ]
    outs = []
    for engine in (Engine(model, **KW), Engine(model, mtp=mtp, speculative_tokens=2, **KW)):
        with Orchestrator(engine) as orch:
            first = orch.generate(reqs)
            again = orch.generate(reqs[:2])  # the prompt cache's entry this time
        outs.append(first + again)
        if engine.tokens_per_step > 1:
            assert engine.prefill_counts["rows"] < len(reqs)  # the group was forked, not prefilled 6 times
    for a, b in zip(*outs):
        assert b.tokens == a.tokens
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-5)
