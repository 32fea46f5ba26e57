"""Logits parity with transformers' PyTorch Qwen 3.5 on tiny random configs (every weight perturbed),
both checkpoint layouts; bfloat16 compute stays close and the logits stay float32."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import hf_logits, load_hf_torch, make_tiny_hf_checkpoint, make_tiny_hf_model, random_ids

from tmax_jax.checkpoints import load_hf

forward = nnx.jit(lambda model, ids: model(ids))
hidden_states = nnx.jit(lambda model, ids: model.hidden_states(ids))

pytest.importorskip("torch")

CASES = {
    # 3 DeltaNet + 1 attention, GQA 4:2, untied, linear key heads repeated 2x to value heads.
    "text-gqa-untied": dict(layout="text", tie_word_embeddings=False),
    # The published VLM layout, tied head, attention every 2nd layer, no GQA, equal linear heads.
    "vlm-tied-interval2": dict(
        layout="vlm",
        tie_word_embeddings=True,
        full_attention_interval=2,
        num_key_value_heads=4,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    kw = dict(CASES[request.param])
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), seed=len(request.param), **kw)
    return request.param, path, load_hf(path, dtype="float32"), load_hf_torch(path)


@pytest.mark.parametrize("batch,length", [(2, 77), (1, 130)])
def test_logits_match_transformers_float32(case, batch, length):
    name, _, model, torch_model = case
    ids = random_ids(np.random.default_rng(batch * 1000 + length), batch, length, 256)
    ref = hf_logits(torch_model, ids)
    logits = forward(model, jnp.asarray(ids))
    assert logits.dtype == jnp.float32 and logits.shape == ref.shape
    np.testing.assert_allclose(np.asarray(logits), ref, atol=2e-5, rtol=2e-4, err_msg=name)


def test_every_weight_was_perturbed():
    model = make_tiny_hf_model(layout="text")
    for name, p in model.named_parameters():
        flat = p.detach().flatten()
        assert float(flat.std()) > 1e-3 or float((flat - flat.mean()).abs().max()) > 1e-3, name
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            assert float(flat.abs().max()) > 0.05 and not np.allclose(flat.numpy(), 1.0), name


def test_bfloat16_compute_is_close_to_float32_and_logits_stay_float32(case):
    _, path, model, _ = case
    ids = random_ids(np.random.default_rng(7), 2, 77, 256)
    ref = np.asarray(forward(model, jnp.asarray(ids)))
    model16 = load_hf(path, dtype="bfloat16")
    assert model16.embed_tokens[...].dtype == jnp.bfloat16
    logits16 = forward(model16, jnp.asarray(ids))
    assert logits16.dtype == jnp.float32
    err = np.abs(np.asarray(logits16) - ref)
    scale = np.abs(ref).max()
    assert err.max() < 0.05 * scale, (err.max(), scale)
    # Greedy choices mostly agree even after bf16 rounding of every activation.
    assert (np.asarray(logits16).argmax(-1) == ref.argmax(-1)).mean() > 0.9


def test_hidden_states_times_lm_head_weight_is_the_logits(case):
    _, _, model, _ = case
    ids = jnp.asarray(random_ids(np.random.default_rng(3), 2, 77, 256))
    hidden = hidden_states(model, ids)
    assert hidden.dtype == jnp.float32
    w = model.lm_head_weight()
    assert w.shape == (model.config.hidden_size, model.config.vocab_size)
    np.testing.assert_allclose(
        np.asarray(hidden, np.float64) @ np.asarray(w, np.float64),
        np.asarray(forward(model, ids)),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("top_level", [False, None])
def test_vlm_head_follows_the_top_level_tie_and_is_never_dropped(top_level, tmp_path):
    """text_config says tie, the top level says no (or omits it, default False): transformers'
    Qwen3_5ForConditionalGeneration keeps its own lm_head. load_hf must too, and save_hf must export a
    text-layout checkpoint that transformers reads back with the same logits."""
    import json

    import torch
    from helpers_hf import perturb_, tiny_text_config
    from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tmax_jax.checkpoints import save_hf

    torch.manual_seed(5)
    text = tiny_text_config(tie_word_embeddings=True)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    kw = {} if top_level is None else {"tie_word_embeddings": top_level}
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision, **kw))
    perturb_(hf, 5)
    hf.float().eval()
    src = tmp_path / "vlm"
    hf.save_pretrained(str(src))
    raw = json.loads((src / "config.json").read_text())
    if top_level is None:
        raw.pop("tie_word_embeddings", None)
        (src / "config.json").write_text(json.dumps(raw))
    assert raw["text_config"]["tie_word_embeddings"] is True

    ref_model = Qwen3_5ForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32).eval()
    head = ref_model.lm_head.weight.detach().numpy()
    embed = ref_model.model.language_model.embed_tokens.weight.detach().numpy()
    assert np.abs(head - embed).max() > 1e-3  # transformers did not tie: the head is its own

    ids = random_ids(np.random.default_rng(11), 2, 45, 256)
    ref = hf_logits(ref_model, ids)
    model = load_hf(src, dtype="float32")
    assert not model.config.tie_word_embeddings
    np.testing.assert_allclose(np.asarray(model.lm_head_weight()).T, head, rtol=0, atol=0)
    logits = np.asarray(forward(model, jnp.asarray(ids)))
    np.testing.assert_allclose(logits, ref, atol=2e-5, rtol=2e-4)

    out = save_hf(model, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(back, ids), ref, atol=2e-5, rtol=2e-4)


def test_flash_attention_path_matches_transformers_with_packing(case):
    """Attention blocks of 32 (the flash form with its own backward, and the GPU Triton kernel in
    Pallas interpret mode) on packed rows: logits match transformers run on each packed sequence
    alone, and gradients match the unblocked path."""
    import jax

    from tmax_jax.models.qwen35.attention import GatedAttention

    name, path, _, torch_model = case
    model = load_hf(path, dtype="float32")
    attn = [m for _, m in nnx.iter_graph(model) if isinstance(m, GatedAttention)]
    assert attn
    ids = random_ids(np.random.default_rng(5), 1, 130, 256)
    seg = np.ones((1, 130), np.int32)
    seg[0, 50:] = 2
    ref = np.concatenate([hf_logits(torch_model, ids[:, :50]), hf_logits(torch_model, ids[:, 50:])], axis=1)

    def loss(model):
        logits = model(jnp.asarray(ids), segment_ids=jnp.asarray(seg))
        return (logits**2).mean(), logits

    grads = {}
    # Past the block: the JAX flash form, then ("pallas") the GPU Triton kernel in interpret mode.
    for block, kernels in ((1024, "auto"), (32, "auto"), (32, "pallas")):
        for a in attn:
            a.query_block, a.kernels = block, kernels
        (_, logits), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        np.testing.assert_allclose(
            np.asarray(logits), ref, atol=2e-5, rtol=2e-4, err_msg=f"{name} {block} {kernels}"
        )
        grads[block, kernels] = g
    for other in ((32, "auto"), (32, "pallas")):
        for a, b in zip(jax.tree.leaves(grads[1024, "auto"]), jax.tree.leaves(grads[other])):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-4, err_msg=str(other))


def test_layer_checkpoints_and_chunked_mlp_change_neither_logits_nor_gradients(case):
    """remat="full" (one checkpoint per period, two hand-made ones per layer, the mixers' stages
    checkpointed) with the MLP and the mixers' token-wise stages in chunks of 16 tokens (77 tokens:
    a padded last chunk): logits still match transformers and every gradient matches the plain
    model's."""
    import jax

    from tmax_jax.models.qwen35.attention import GatedAttention
    from tmax_jax.models.qwen35.deltanet import GatedDeltaNet
    from tmax_jax.models.qwen35.mlp import SwiGLU

    name, path, _, torch_model = case
    ids = random_ids(np.random.default_rng(9), 2, 77, 256)
    ref = hf_logits(torch_model, ids)

    def loss(model):
        logits = model(jnp.asarray(ids))
        return (logits**2).mean(), logits

    out = {}
    for remat, chunk in (("none", 1024), ("full", 16)):
        model = load_hf(path, dtype="float32", remat=remat)
        for _, m in nnx.iter_graph(model):
            if isinstance(m, SwiGLU):
                m.chunk = chunk
            if isinstance(m, (GatedAttention, GatedDeltaNet)):
                m.token_chunk = chunk
        (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        np.testing.assert_allclose(np.asarray(logits), ref, atol=2e-5, rtol=2e-4, err_msg=f"{name} {remat}")
        out[remat] = grads
    for a, b in zip(jax.tree.leaves(out["none"]), jax.tree.leaves(out["full"])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-4)
