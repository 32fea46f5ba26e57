"""Qwen3 dense (transformers ``qwen3``) through the same load_hf / save_hf / engine / train step as
Qwen 3.5: logits against transformers' Qwen3ForCausalLM on a tiny random config with every weight
perturbed, the export reloaded by transformers, greedy decoding against transformers' generate."""

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import hf_logits, perturb_, random_ids

from tmax_jax.checkpoints import load_hf, save_hf
from tmax_jax.errors import ConfigError
from tmax_jax.models.qwen35 import Qwen35Config

torch = pytest.importorskip("torch")
forward = nnx.jit(lambda model, ids: model(ids))

TINY_QWEN3 = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def make_qwen3(tmp_path, seed=0, **overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3ForCausalLM(Qwen3Config(**{**TINY_QWEN3, **overrides}))
    perturb_(hf, seed)
    hf.float().eval()
    out = tmp_path / f"qwen3-{seed}"
    hf.save_pretrained(str(out))
    return out, hf


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    path, hf = make_qwen3(tmp_path_factory.mktemp("qwen3"), seed=3, tie_word_embeddings=False)
    return path, hf, load_hf(path, dtype="float32")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def case(request, untied, tmp_path_factory):
    if not request.param:
        return untied
    path, hf = make_qwen3(tmp_path_factory.mktemp("qwen3"), seed=4, tie_word_embeddings=True)
    return path, hf, load_hf(path, dtype="float32")


def test_config_reads_qwen3(case):
    path, hf, model = case
    cfg = model.config
    assert cfg.family == "qwen3" and not cfg.attn_output_gate and not cfg.zero_centred_norms
    assert cfg.layer_types == ("full_attention",) * 3 and cfg.rotary_dim == cfg.head_dim == 16
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert model.blocks.layers[0].self_attn.q_proj[...].shape == (3, 32, 4, 16)  # 3 periods; no gate half


def test_logits_match_transformers(case):
    path, hf, model = case
    ids = random_ids(np.random.default_rng(0), 2, 41, 256)
    ref = hf_logits(hf, ids)
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    assert np.abs(ours - ref).max() <= 2e-4 * np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=2e-4)


def test_packed_rows_match_each_sequence_alone(untied):
    path, hf, model = untied
    ids = random_ids(np.random.default_rng(1), 1, 40, 256)
    seg = np.ones((1, 40), np.int32)
    seg[0, 15:] = 2
    ref = np.concatenate([hf_logits(hf, ids[:, :15]), hf_logits(hf, ids[:, 15:])], axis=1)
    ours = np.asarray(nnx.jit(lambda m, i, s: m(i, segment_ids=s))(model, jnp.asarray(ids), jnp.asarray(seg)))
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=2e-4)


def test_export_reloads_in_transformers_with_the_same_logits(case, tmp_path):
    from transformers import AutoModelForCausalLM

    path, hf, model = case
    out = save_hf(model, tmp_path / "export")
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "qwen3" and raw["architectures"] == ["Qwen3ForCausalLM"]
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    ids = random_ids(np.random.default_rng(2), 2, 23, 256)
    np.testing.assert_allclose(hf_logits(back, ids), hf_logits(hf, ids), atol=1e-6, rtol=1e-6)
    assert Qwen35Config.from_hf_config(raw) == model.config


def test_engine_greedy_is_transformers_argmax(untied):
    from tmax_jax.engine import generate

    path, hf, model = untied
    prompts = [[200, 1, 64, 64, 8, 31, 77]]
    outs = generate(model, prompts, max_new_tokens=8, temperature=0.0)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.tokens == ref


def test_train_step_runs_and_moves_the_loss(untied):
    import jax

    from tmax_jax.rl import OptimizerConfig, RLConfig
    from tmax_jax.rl.train_step import TrainStep
    from tmax_jax.sharding import MeshConfig, make_mesh

    path, hf, _ = untied
    model = load_hf(path, dtype="float32")
    mesh_cfg = MeshConfig(data=1, fsdp=1, tensor=1)
    rl = RLConfig(optimizer=OptimizerConfig(learning_rate=3e-3, grad_clip_norm=1.0))
    step = TrainStep(model, rl, make_mesh(mesh_cfg, jax.devices()[:1]), mesh_cfg)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 256, (2, 24)).astype(np.int32)
    batch = {
        "input_ids": ids,
        "targets": np.roll(ids, -1, axis=1),
        "positions": np.broadcast_to(np.arange(24, dtype=np.int32), (2, 24)).copy(),
        "segment_ids": np.ones((2, 24), np.int32),
        "response_mask": np.concatenate([np.zeros((2, 8)), np.ones((2, 16))], 1).astype(np.float32),
        "advantages": np.array([[1.0] * 24, [-1.0] * 24], np.float32),
        "rollout_logprobs": np.full((2, 24), -5.5, np.float32),
    }
    state = step.init_state()
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_yarn_rope_scaling_matches_transformers(tmp_path):
    """YaRN (Qwen3's documented context extension: rope_scaling type "yarn", factor 4 over 32768
    positions), here over 12 original positions, so the 41-token rows run well past them; the
    export keeps it and reloads in transformers to the same logits."""
    from transformers import AutoModelForCausalLM

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 12}
    path, hf = make_qwen3(tmp_path, seed=5, rope_parameters=yarn, max_position_embeddings=48)
    model = load_hf(path, dtype="float32")
    assert model.config.yarn == (4.0, 12)
    ids = random_ids(np.random.default_rng(3), 2, 41, 256)
    ref = hf_logits(hf, ids)
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=2e-4)
    plain = load_hf(path, dtype="float32")  # the same weights without YaRN
    plain.config = dataclasses.replace(model.config, yarn_factor=0.0, yarn_original_max_position_embeddings=0)
    assert np.abs(np.asarray(forward(plain, jnp.asarray(ids))) - ref).max() > 1e-3  # ... YaRN matters
    back = AutoModelForCausalLM.from_pretrained(str(save_hf(model, tmp_path / "export")), dtype=torch.float32)
    np.testing.assert_allclose(hf_logits(back.eval(), ids), ref, atol=1e-6, rtol=1e-6)
    with pytest.raises(ConfigError, match="mscale"):
        Qwen35Config.from_hf_config(
            {**TINY_QWEN3, "model_type": "qwen3", "rope_parameters": {**yarn, "mscale": 2}}
        )


def test_unsupported_qwen3_configs_are_named():
    base = {**TINY_QWEN3, "model_type": "qwen3"}
    with pytest.raises(ConfigError, match="use_sliding_window"):
        Qwen35Config.from_hf_config({**base, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="attention_bias"):
        Qwen35Config.from_hf_config({**base, "attention_bias": True})
    with pytest.raises(ConfigError, match="linear"):
        Qwen35Config(
            family="qwen3", num_hidden_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",)
        )
    assert Qwen35Config.preset("qwen3-8b").num_full_layers == 36


def test_yarn_config_needs_a_yarn_checkpoint(tmp_path):
    """configs/qwen3-8b-8xh200.yaml plans YaRN: train refuses a Qwen3 checkpoint without it, by name."""
    from tmax_jax.train.config import load_train_config
    from tmax_jax.train.setup import _check_shape

    yaml_path = Path(__file__).resolve().parents[1] / "configs" / "qwen3-8b-8xh200.yaml"
    cfg = load_train_config(yaml_path, {"model": {"checkpoint": str(tmp_path)}})
    assert cfg.model.shape().yarn == (4.0, 32768) and cfg.seq_len <= 4 * 32768
    hf = Qwen35Config.preset("qwen3-8b").to_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=r"yarn_factor: 0.0 != 4.0"):
        _check_shape(cfg, tmp_path)
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps({**hf, "rope_parameters": yarn}))
    _check_shape(cfg, tmp_path)
