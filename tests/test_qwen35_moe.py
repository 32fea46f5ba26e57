"""Qwen 3.5 MoE (transformers ``qwen3_5_moe``): the sparse block against NumPy float64, logits against
Qwen3_5MoeForCausalLM / Qwen3_5MoeForConditionalGeneration on tiny random configs with every weight
perturbed (per-expert and fused expert tensors), export reloaded by transformers, router load and
aux loss against transformers' router logits, engine greedy decoding, a train step, and experts
sharded over 8 fake CPU devices."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import hf_logits, perturb_, random_ids, tiny_text_config

from tmax_jax.checkpoints import load_hf, save_hf
from tmax_jax.checkpoints.safetensors_io import SafetensorsFile, write_safetensors
from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.models.qwen35.moe import grouped_experts, route

torch = pytest.importorskip("torch")
forward = nnx.jit(lambda model, ids: model(ids))
MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def moe_text_config(**overrides):
    cfg = tiny_text_config(**MOE, **overrides)
    cfg.pop("intermediate_size")
    return cfg


def make_moe(layout="text", seed=0, **overrides):
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    torch.manual_seed(seed)
    text = moe_text_config(**overrides)
    if layout == "text":
        hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text))
    else:
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
        hf = Qwen3_5MoeForConditionalGeneration(
            Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        )
    perturb_(hf, seed)
    return hf.float().eval()


@pytest.fixture(scope="module")
def text_case(tmp_path_factory):
    hf = make_moe("text", seed=2)
    path = tmp_path_factory.mktemp("moe") / "text"
    hf.save_pretrained(str(path))  # transformers writes one tensor per expert
    return path, hf, load_hf(path, dtype="float32")


def test_sparse_block_matches_numpy_float64():
    rng = np.random.default_rng(0)
    N, D, E, K, I = 37, 12, 6, 2, 5
    x = rng.normal(size=(N, D))
    logits = rng.normal(size=(N, E)) * 2
    wgu = rng.normal(size=(E, D, 2, I)) * 0.3
    wd = rng.normal(size=(E, I, D)) * 0.3
    probs, weights, experts = route(jnp.asarray(logits, jnp.float32), K, True)
    y = grouped_experts(jnp.asarray(x, jnp.float32), experts, weights, jnp.asarray(wgu, jnp.float32),
                        jnp.asarray(wd, jnp.float32))  # fmt: skip

    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.zeros((N, D))
    for n in range(N):
        top = np.argsort(-p[n])[:K]
        w = p[n, top] / p[n, top].sum()
        for e, we in zip(top, w):
            g, u = x[n] @ wgu[e, :, 0], x[n] @ wgu[e, :, 1]
            ref[n] += we * ((g / (1 + np.exp(-g))) * u) @ wd[e]
    np.testing.assert_allclose(np.asarray(probs), p, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5, rtol=1e-5)

    # Gradients equal those of the dense formulation (every expert on every token, masked weights).
    def dense(x, wgu, wd):
        h = jnp.einsum("nd,edci->neci", x, wgu)
        out = jnp.einsum("nei,eid->ned", jax.nn.silu(h[:, :, 0]) * h[:, :, 1], wd)
        mask = jax.nn.one_hot(experts, E).transpose(0, 2, 1) @ weights[..., None]  # [N, E, 1]
        return jnp.sum(out * mask, 1)

    args = tuple(jnp.asarray(a, jnp.float32) for a in (x, wgu, wd))
    ct = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    g_ragged = jax.grad(lambda *a: jnp.sum(grouped_experts(a[0], experts, weights, *a[1:]) * ct), (0, 1, 2))(
        *args
    )
    g_dense = jax.grad(lambda *a: jnp.sum(dense(*a) * ct), (0, 1, 2))(*args)
    for a, b in zip(g_ragged, g_dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_config_from_transformers(text_case):
    path, hf, model = text_case
    cfg = model.config
    assert cfg.is_moe and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 3)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (16, 24)
    assert model.blocks.layers[0].mlp.gate_up_proj[...].shape == (1, 8, 32, 2, 16)


def test_per_expert_checkpoint_logits_match_transformers(text_case):
    path, hf, model = text_case
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in SafetensorsFile(path / "model.safetensors").keys()
    ids = random_ids(np.random.default_rng(0), 2, 41, 256)
    ref = hf_logits(hf, ids)
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    assert np.abs(ours - ref).max() <= 2e-4 * np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=2e-4)


def test_fused_checkpoint_and_export_reload(text_case, tmp_path):
    """transformers' in-memory tensors (fused gate_up_proj [E, 2I, D], as the published checkpoints
    store them) load to the same model; save_hf's export reloads in transformers to the same logits."""
    from transformers import AutoModelForCausalLM

    path, hf, model = text_case
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    write_safetensors(fused / "model.safetensors", state.items())
    (fused / "config.json").write_text((path / "config.json").read_text())
    ids = random_ids(np.random.default_rng(1), 2, 29, 256)
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    np.testing.assert_array_equal(np.asarray(forward(load_hf(fused), jnp.asarray(ids))), ours)

    out = save_hf(model, tmp_path / "export")
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe_text" and raw["architectures"] == ["Qwen3_5MoeForCausalLM"]
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3_5MoeForCausalLM"
    for (name, a), b in zip(back.state_dict().items(), hf.state_dict().values()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
    np.testing.assert_allclose(hf_logits(back, ids), ours, atol=2e-5, rtol=2e-4)


def test_vlm_layout_logits_match_transformers(tmp_path):
    hf = make_moe("vlm", seed=4)
    hf.save_pretrained(str(tmp_path / "vlm"))
    model = load_hf(tmp_path / "vlm", dtype="float32")
    assert model.config.is_moe
    ids = random_ids(np.random.default_rng(2), 2, 33, 256)
    ref = hf_logits(hf, ids)
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(ids))), ref, atol=2e-5, rtol=2e-4)


def test_router_load_and_aux_loss_match_transformers(text_case):
    path, hf, model = text_case
    ids = random_ids(np.random.default_rng(3), 2, 30, 256)
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(ids, dtype=torch.long), output_router_logits=True)
    hidden, stats = nnx.jit(lambda m, i: m.hidden_states(i, router_stats=True))(model, jnp.asarray(ids))
    E, K = 8, 3
    for layer, logits in enumerate(out.router_logits):
        top = torch.topk(torch.softmax(logits.double(), -1), K, -1).indices.numpy()
        share = np.bincount(top.reshape(-1), minlength=E) / top.size
        np.testing.assert_allclose(np.asarray(stats.load()[layer]), share, atol=1e-6)
    coef = hf.config.router_aux_loss_coef
    np.testing.assert_allclose(float(model.router_aux_loss(stats)), coef * float(out.aux_loss), rtol=1e-5)
    m = stats.metrics()
    assert float(m["router/max_load"]) >= 1.0 >= float(m["router/min_load"])
    np.testing.assert_allclose(
        np.asarray(hidden) @ np.asarray(model.lm_head_weight()), out.logits.numpy(), atol=2e-5, rtol=2e-4
    )


def test_engine_greedy_is_transformers_argmax(text_case):
    from tmax_jax.engine import generate

    path, hf, model = text_case
    prompts = [[200, 1, 64, 64, 8, 31, 77]]
    outs = generate(model, prompts, max_new_tokens=6, temperature=0.0)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.tokens == ref


def _batch(rows=8, T=24, seed=4):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, (rows, T)).astype(np.int32)
    return {
        "input_ids": ids,
        "targets": np.roll(ids, -1, axis=1),
        "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (rows, T)).copy(),
        "segment_ids": np.ones((rows, T), np.int32),
        "response_mask": np.concatenate([np.zeros((rows, 8)), np.ones((rows, T - 8))], 1).astype(np.float32),
        "advantages": np.where(np.arange(rows)[:, None] % 2, 1.0, -1.0).repeat(T, 1).astype(np.float32),
        "rollout_logprobs": np.full((rows, T), -5.5, np.float32),
    }


def test_experts_shard_over_fsdp_and_the_sharded_forward_matches(text_case):
    """fsdp=4 x tensor=2 with the default rules: each device holds 2 whole experts (expert axis over
    fsdp) and half of their intermediate axis (tensor); the jitted forward on the mesh gives the
    unsharded model's logits."""
    from tmax_jax import sharding as shd

    path, _, model = text_case
    assert len(jax.devices()) == 8
    mesh_cfg = shd.MeshConfig(data=1, fsdp=4, tensor=2)
    mesh = shd.make_mesh(mesh_cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sharded = shd.shard_tree(params, shd.param_shardings(params, mesh, mesh_cfg))
    mlp = sharded["blocks"]["layers"][0]["mlp"]
    gate_up, down = mlp["gate_up_proj"][...], mlp["down_proj"][...]
    assert gate_up.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None, None, "tensor")
    assert gate_up.addressable_shards[0].data.shape == (1, 2, 32, 2, 8)
    assert down.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    ids = jnp.asarray(random_ids(np.random.default_rng(6), 8, 16, 256))
    with jax.set_mesh(mesh):
        run = jax.jit(lambda p, i: nnx.merge(graphdef, p, rest)(i))
        logits = run(sharded, jax.device_put(ids, shd.batch_sharding(mesh)))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(forward(model, ids)), atol=2e-5, rtol=2e-5)


def test_train_step_runs(text_case):
    from tmax_jax.rl import OptimizerConfig, RLConfig
    from tmax_jax.rl.train_step import TrainStep
    from tmax_jax.sharding import MeshConfig, make_mesh

    path, _, _ = text_case
    mesh_cfg = MeshConfig(data=1, fsdp=1, tensor=1)
    rl = RLConfig(optimizer=OptimizerConfig(learning_rate=3e-3, grad_clip_norm=1.0))
    step = TrainStep(load_hf(path), rl, make_mesh(mesh_cfg, jax.devices()[:1]), mesh_cfg)
    state = step.init_state()
    before = np.asarray(state.params["blocks"]["layers"][0]["mlp"]["gate_up_proj"][...])
    losses = []
    for _ in range(2):
        state, metrics = step(state, _batch(rows=2))
        losses.append(float(metrics["loss"]))
    after = np.asarray(state.params["blocks"]["layers"][0]["mlp"]["gate_up_proj"][...])
    assert np.isfinite(losses).all() and losses[1] < losses[0] and np.abs(after - before).max() > 0


def test_router_stats_under_remat_give_aux_loss_gradients(text_case):
    path, _, _ = text_case
    model = load_hf(path, remat="full")
    ids = jnp.asarray(random_ids(np.random.default_rng(5), 1, 8, 256))

    def loss(m):
        _, stats = m.hidden_states(ids, router_stats=True)
        return m.router_aux_loss(stats)

    grads = nnx.jit(nnx.grad(loss))(model)
    router_grad = np.asarray(grads["blocks"]["layers"][0]["mlp"]["router"][...])
    assert np.isfinite(router_grad).all() and np.abs(router_grad).max() > 0


def test_presets_and_bad_configs():
    from tmax_jax.errors import ConfigError

    a3b = Qwen35Config.preset("35b-a3b")
    assert (
        a3b.is_moe and a3b.num_experts == 256 and a3b.num_experts_per_tok == 8 and a3b.num_hidden_layers == 40
    )
    assert Qwen35Config.preset("122b-a10b").num_hidden_layers == 48
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        Qwen35Config.preset("tiny-moe", num_experts_per_tok=9)
    with pytest.raises(ConfigError, match="num_experts"):
        Qwen35Config.from_hf_config({**moe_text_config(), "model_type": "qwen3_5_text"})
