"""The engine against independent references: transformers' greedy generate and log-softmax, and the
trainer's teacher-forced ``tmax_jax.rl.token_logprobs`` on the same weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import load_hf_torch, make_tiny_hf_checkpoint

from tmax_jax.checkpoints import load_hf
from tmax_jax.engine import generate
from tmax_jax.rl.logprobs import token_logprobs

PROMPT_LENGTHS = (3, 9, 17, 30, 6)
NEW = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("engine_parity"), seed=3)


@pytest.fixture(scope="module")
def jax_model(ckpt):
    return load_hf(ckpt)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, size=n).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model, prompt, n):
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logp = [torch.log_softmax(lg[0].double(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    return tokens, logp


def teacher_forced(model, prompts, outs, temperature):
    """The trainer's logprobs of each output's tokens: one jitted, right-padded full forward."""
    width = 64
    seqs = np.zeros((len(prompts), width), np.int32)
    segs = np.zeros((len(prompts), width), np.int32)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        row = list(p) + list(o.tokens)
        seqs[i, : len(row)], segs[i, : len(row)] = row, 1
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, seq, seg):
        m = nnx.merge(graphdef, state)
        hidden = m.hidden_states(seq, segment_ids=seg)
        return token_logprobs(hidden[:, :-1], m.lm_head_weight(), seq[:, 1:], temperature=temperature)

    lp = np.asarray(run(state, jnp.asarray(seqs), jnp.asarray(segs)))
    return [lp[i, len(p) - 1 : len(p) - 1 + len(o.tokens)] for i, (p, o) in enumerate(zip(prompts, outs))]


def test_greedy_matches_transformers_generate(ckpt, jax_model, prompts):
    hf = load_hf_torch(ckpt)
    outs = generate(jax_model, prompts, max_new_tokens=NEW, temperature=0.0)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logp = hf_greedy(hf, prompt, NEW)
        assert len(set(ref_tokens)) > 2, "degenerate reference; pick another seed"
        assert out.tokens == ref_tokens
        np.testing.assert_allclose(out.logprobs, ref_logp, atol=2e-4)
        assert out.finish_reason == "length"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_trainer_logprobs(jax_model, prompts, temperature):
    outs = generate(jax_model, prompts, max_new_tokens=NEW, temperature=temperature, seed=5)
    for out, ref in zip(outs, teacher_forced(jax_model, prompts, outs, temperature)):
        np.testing.assert_allclose(out.logprobs, ref, atol=2e-5, rtol=1e-5)


def test_seeds_control_sampling(jax_model, prompts):
    a = generate(jax_model, prompts, max_new_tokens=NEW, temperature=1.0, seed=1)
    b = generate(jax_model, prompts, max_new_tokens=NEW, temperature=1.0, seed=1)
    c = generate(jax_model, prompts, max_new_tokens=NEW, temperature=1.0, seed=2)
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    assert sum(x.tokens != y.tokens for x, y in zip(a, c)) >= len(prompts) - 1


def test_generation_stops_after_eos_included(jax_model, prompts):
    free = generate(jax_model, prompts, max_new_tokens=NEW, temperature=0.0)
    eos = free[0].tokens[4]  # make the 5th greedy token the stop token
    outs = generate(jax_model, prompts, max_new_tokens=NEW, temperature=0.0, eos_token_id=eos)
    cut = free[0].tokens.index(eos) + 1
    assert outs[0].tokens == free[0].tokens[:cut] and outs[0].finish_reason == "stop"
    assert len(outs[0].logprobs) == cut
    for f, o in zip(free[1:], outs[1:]):
        if eos in f.tokens:
            assert o.tokens == f.tokens[: f.tokens.index(eos) + 1] and o.finish_reason == "stop"
        else:
            assert o.tokens == f.tokens and o.finish_reason == "length"


def test_bfloat16_logprob_gap(ckpt, prompts):
    """bf16 weights and caches: engine vs trainer recompute on the same weights; the gap is reported."""
    model = load_hf(ckpt, "bfloat16")
    outs = generate(model, prompts, max_new_tokens=NEW, temperature=1.0, seed=9, cache_dtype=jnp.bfloat16)
    refs = teacher_forced(model, prompts, outs, 1.0)
    gaps = [np.abs(np.asarray(o.logprobs) - r) for o, r in zip(outs, refs)]
    gap = np.concatenate(gaps)
    print(f"bf16 engine-vs-trainer logprob gap: max {gap.max():.4f}, mean {gap.mean():.5f}")
    # Both sides round activations to bf16 at different points (decode vs full forward), so they
    # differ by bf16 noise; an indexing or temperature bug would be off by whole nats.
    assert gap.mean() < 0.05 and gap.max() < 0.5


def test_bfloat16_compute_with_float32_params(ckpt, prompts):
    """A bf16-compute model with float32 parameters (the trainer's): the engine keeps the layers'
    matmul weights in bf16 (the cast each layer makes anyway) and the norms, gates and head in
    float32; its logprobs stay within bf16 noise of the trainer's recompute."""
    from tmax_jax.engine import Engine
    from tmax_jax.models.qwen35 import Qwen35ForCausalLM

    ref = load_hf(ckpt)
    model = Qwen35ForCausalLM(ref.config, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(ref))
    engine = Engine(model, max_concurrent_decodes=2, max_cache_length=64, max_prefill_length=32)
    dtypes = {
        jax.tree_util.keystr(path): a.dtype for path, a in jax.tree_util.tree_leaves_with_path(engine.params)
    }
    assert any("in_proj_qkv" in k for k in dtypes) and any("q_proj" in k for k in dtypes)
    for key, dtype in dtypes.items():
        matmul = any(n in key for n in ("_proj", "conv_weight"))
        assert dtype == (jnp.bfloat16 if matmul else jnp.float32), key
    outs = generate(model, prompts, max_new_tokens=NEW, temperature=1.0, seed=9, cache_dtype=jnp.bfloat16)
    gap = np.concatenate(
        [np.abs(np.asarray(o.logprobs) - r) for o, r in zip(outs, teacher_forced(model, prompts, outs, 1.0))]
    )
    assert gap.mean() < 0.05 and gap.max() < 0.5
