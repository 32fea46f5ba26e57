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

    # Routing replay: odd tokens use given expert ids (weights = this router's renormalised
    # probabilities at them), even tokens (-1) their own top-k.
    replay = np.stack([rng.permutation(E)[:K] for _ in range(N)])
    replay[::2] = -1
    _, w_r, e_r = route(jnp.asarray(logits, jnp.float32), K, True, jnp.asarray(replay, jnp.int32))
    want_e = np.where(replay[:, :1] >= 0, replay, np.asarray(experts))
    np.testing.assert_array_equal(np.asarray(e_r), want_e)
    want_w = np.take_along_axis(p, want_e, -1)
    np.testing.assert_allclose(np.asarray(w_r), want_w / want_w.sum(-1, keepdims=True), atol=1e-6)

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


def test_train_step_replays_routing_and_reports_router_load(text_case):
    """A train step with routing replay (half the rows carry recorded ids, the rest -1) learns, and
    its router/* metrics are those of the experts its forward used (NumPy from the ids); the router
    aux loss is off by default."""
    from tmax_jax.rl import OptimizerConfig, RLConfig
    from tmax_jax.rl.config import TrainStepConfig
    from tmax_jax.rl.train_step import ROUTING_FIELD, TrainStep
    from tmax_jax.sharding import MeshConfig, make_mesh

    assert RLConfig().train_step.router_aux_loss_coef == 0.0 and not RLConfig().train_step.routing_replay
    path, _, _ = text_case
    model = load_hf(path)  # the train step takes (donates) its params: not the fixture's model
    batch = _batch(rows=2)
    ids = jnp.asarray(batch["input_ids"])
    # Recorded ids for row 0: its experts under another model (a different seed's router), so the
    # replayed routing differs from what this model would pick.
    other = load_hf(path)
    o_params = nnx.state(other, nnx.Param)
    r = o_params["blocks"]["layers"][0]["mlp"]["router"]
    r.set_value(r[...][:, :, ::-1])  # experts relabelled: other choices, same router statistics
    _, recorded = nnx.jit(lambda m, i: m.hidden_states(i, return_routing=True))(other, ids)
    routed = np.asarray(recorded).transpose(1, 2, 0, 3).copy()  # [B, T, L, K]
    routed[1] = -1
    batch[ROUTING_FIELD] = routed.astype(np.int16)
    _, own = nnx.jit(lambda m, i: m.hidden_states(i, return_routing=True))(model, ids)
    used = np.where(routed.transpose(2, 0, 1, 3)[..., :1] >= 0, routed.transpose(2, 0, 1, 3), np.asarray(own))
    assert (np.sort(used, -1) != np.sort(np.asarray(own), -1)).any()

    mesh_cfg = MeshConfig(data=1, fsdp=1, tensor=1)
    rl = RLConfig(
        optimizer=OptimizerConfig(learning_rate=3e-3, grad_clip_norm=1.0),
        train_step=TrainStepConfig(routing_replay=True),
    )
    step = TrainStep(model, rl, make_mesh(mesh_cfg, jax.devices()[:1]), mesh_cfg)
    state = step.init_state()
    before = np.asarray(state.params["blocks"]["layers"][0]["mlp"]["router"][...])
    losses, first = [], None
    for _ in range(2):
        state, metrics = step(state, batch)
        first = first or metrics
        losses.append(float(metrics["loss"]))
    after = np.asarray(state.params["blocks"]["layers"][0]["mlp"]["router"][...])
    assert np.isfinite(losses).all() and losses[1] < losses[0] and np.abs(after - before).max() > 0

    E = 8
    load = np.stack([np.bincount(u.reshape(-1), minlength=E) for u in used]).astype(np.float64)
    load /= load.sum(-1, keepdims=True)
    ent = -np.sum(np.where(load > 0, load * np.log(np.where(load > 0, load, 1)), 0), -1) / np.log(E)
    np.testing.assert_allclose(float(first["router/max_load"]), load.max(-1).mean() * E, rtol=1e-5)
    np.testing.assert_allclose(float(first["router/min_load"]), load.min(-1).mean() * E, rtol=1e-5)
    np.testing.assert_allclose(float(first["router/load_entropy"]), ent.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(first["router/idle_experts"]), (load == 0).mean(), rtol=1e-6)


@pytest.mark.parametrize("remat", ["full", "layers"])
def test_router_stats_and_replay_under_remat_give_router_gradients(text_case, remat):
    """remat="full" or "layers" (per-layer hand-made checkpoints): router stats, replayed ids and the
    ids used pass through the checkpoints; the aux loss reaches the router, and with every token
    replayed the ids used are the replayed ones."""
    path, _, _ = text_case
    model = load_hf(path, remat=remat)
    ids = jnp.asarray(random_ids(np.random.default_rng(5), 1, 8, 256))
    replay = jnp.asarray(
        np.stack([np.random.default_rng(i).permutation(8)[:3] for i in range(32)]).reshape(4, 1, 8, 3)
    )

    def loss(m):
        hidden, stats, used = m.hidden_states(ids, router_stats=True, routing=replay, return_routing=True)
        return m.router_aux_loss(stats) + 1e-3 * jnp.sum(hidden), used

    grads, used = nnx.jit(nnx.grad(loss, has_aux=True))(model)
    np.testing.assert_array_equal(np.asarray(used), np.asarray(replay))
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


def test_routing_replay_restores_the_engines_experts(text_case):
    """The engine records each decoded token's experts per layer; after a small router change (a
    learner update) the re-routed forward picks other experts for some of those tokens, the replayed
    one uses exactly the engine's, with gradients still reaching the router. With the engine's own
    weights, replaying its ids gives the trainer's logprobs of the non-replayed path (same ids)."""
    from tmax_jax.engine import Engine, SamplingParams
    from tmax_jax.engine.engine import PrefillRequest
    from tmax_jax.rl.logprobs import token_logprobs

    path, _, model = text_case
    L, K, steps = 4, 3, 8
    engine = Engine(
        model, max_concurrent_decodes=2, max_cache_length=32, max_prefill_length=16, decode_steps=steps,
        min_attend_bucket=32, record_routing=True,
    )  # fmt: skip
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, 9).tolist(), rng.integers(0, 256, 12).tolist()]
    reqs = [
        PrefillRequest(p, SamplingParams(temperature=1.0, seed=s), steps + 1) for s, p in enumerate(prompts)
    ]
    prefixes = engine.prefill_many(engine.params, reqs)
    state = engine.init_decode_state()
    for s, pre in enumerate(prefixes):
        state = engine.insert(pre, state, s)
    _, blk = engine.generate_block(engine.params, state, steps)
    toks, valid, lps, experts = jax.device_get((blk.tokens, blk.valid, blk.log_prob, blk.experts))
    assert experts.shape == (steps, 2, L, K) and valid.all()

    # Rows as the trainer packs them: prompt, first token, decoded tokens; routed ids for the fed ones.
    T = 24
    ids = np.zeros((2, T), np.int32)
    seg = np.zeros((2, T), np.int32)
    routed = np.full((L, 2, T, K), -1, np.int32)
    gen = np.zeros((2, T), bool)
    eng_lp = np.zeros((2, T), np.float32)
    for s, (p, pre) in enumerate(zip(prompts, prefixes)):
        row = p + [int(np.asarray(pre.token)[0])] + toks[:, s].tolist()
        ids[s, : len(row)], seg[s, : len(row)] = row, 1
        routed[:, s, len(p) : len(p) + steps] = experts[:, s].transpose(1, 0, 2)  # step j feeds row[len(p)+j]
        gen[s, len(p) : len(p) + steps] = True  # targets row[len(p)+1 :] were sampled by the blocks
        eng_lp[s, len(p) : len(p) + steps] = lps[:, s]
    targets = np.roll(ids, -1, 1)

    @nnx.jit
    def fwd(m, routing):
        hidden, used = m.hidden_states(jnp.asarray(ids), segment_ids=jnp.asarray(seg), routing=routing,
                                       return_routing=True)  # fmt: skip
        return token_logprobs(hidden, m.lm_head_weight(), jnp.asarray(targets)), used

    lp_route, used_route = jax.device_get(fwd(model, None))
    lp_replay, used_replay = jax.device_get(fwd(model, jnp.asarray(routed)))
    gen_l = np.broadcast_to(gen[None, :, :, None], routed.shape)
    np.testing.assert_array_equal(used_replay[gen_l], routed[gen_l])
    # Same weights: the engine's ids are the trainer's own (f32, no tie flips), so replay changes nothing.
    np.testing.assert_array_equal(used_route[gen_l], routed[gen_l])
    np.testing.assert_array_equal(lp_replay, lp_route)
    np.testing.assert_allclose(lp_replay[gen], eng_lp[gen], atol=2e-5)

    # A small router change flips some of the recorded tokens' experts; replay restores them.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    router = params["blocks"]["layers"][0]["mlp"]["router"]
    w = np.asarray(router[...])
    bumped = jax.tree.map(lambda x: x, params)
    bumped["blocks"]["layers"][0]["mlp"]["router"].set_value(
        jnp.asarray(w + 0.15 * np.random.default_rng(8).normal(size=w.shape) * w.std())
    )
    moved = nnx.merge(graphdef, bumped, rest)
    _, used_moved = jax.device_get(fwd(moved, None))
    _, used_moved_replay = jax.device_get(fwd(moved, jnp.asarray(routed)))
    flipped = (np.sort(used_moved, -1) != np.sort(routed, -1)).any(-1) & gen[None]
    assert flipped.sum() >= 1, "the perturbation should re-route at least one recorded token"
    np.testing.assert_array_equal(used_moved_replay[gen_l], routed[gen_l])

    def loss(m):
        return -jnp.sum(fwd.fun(m, jnp.asarray(routed))[0] * jnp.asarray(gen, jnp.float32))

    g = nnx.grad(loss)(moved)["blocks"]["layers"][0]["mlp"]["router"][...]
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0


def test_checkpoint_with_other_expert_shapes_is_refused_by_name(tmp_path):
    """train's shape check (the plan's preset vs the checkpoint's config.json) names MoE fields."""
    from tmax_jax.errors import ConfigError
    from tmax_jax.train.config import ModelSource, TrainConfig
    from tmax_jax.train.setup import _check_shape

    cfg = TrainConfig(model=ModelSource(preset="tiny-moe", checkpoint=str(tmp_path)))
    for field, value in (("num_experts", 16), ("moe_intermediate_size", 48), ("num_experts_per_tok", 4)):
        hf = Qwen35Config.preset("tiny-moe", **{field: value}).to_hf_config()
        (tmp_path / "config.json").write_text(json.dumps(hf))
        with pytest.raises(ConfigError, match=rf"{field}: {value} != "):
            _check_shape(cfg, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(Qwen35Config.preset("tiny-moe").to_hf_config()))
    _check_shape(cfg, tmp_path)


def _eqns(jaxpr):
    """Every equation of a closed jaxpr, nested ones (scan, remat, custom_vjp, jit) included."""
    from jax.extend.core import jaxprs_in_params

    for eq in jaxpr.eqns:
        yield eq
        for sub in jaxprs_in_params(eq.params):
            yield from _eqns(sub)


def test_bfloat16_compute_with_float32_params_is_close_and_accumulates_in_float32(text_case):
    """bfloat16 compute over float32 params: logits within bfloat16 rounding of the float32 model and
    of transformers (no further from float32 than transformers' own bfloat16 copy, within 1.5x);
    every grouped matmul of the forward and the backward takes bfloat16 operands and accumulates in
    float32; the expert weights' gradients are float32 and close to the float32 model's."""
    import copy

    path, hf, model = text_case
    model16 = load_hf(path, dtype="bfloat16", param_dtype="float32")
    assert model16.blocks.layers[0].mlp.gate_up_proj[...].dtype == jnp.float32
    ids = random_ids(np.random.default_rng(11), 2, 41, 256)
    ref = hf_logits(hf, ids)
    ours32 = np.asarray(forward(model, jnp.asarray(ids)))
    logits16 = forward(model16, jnp.asarray(ids))
    assert logits16.dtype == jnp.float32
    ours16 = np.asarray(logits16)
    hf16 = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids)
    scale = np.abs(ref).max()
    err_ours, err_hf = np.abs(ours16 - ref).max(), np.abs(hf16 - ref).max()
    print(
        f"bf16 max |logit err| / max |logit|: ours {err_ours / scale:.4f}, transformers {err_hf / scale:.4f}"
    )
    assert err_ours < 0.05 * scale and err_ours <= 1.5 * err_hf, (err_ours, err_hf, scale)
    assert np.abs(ours16 - ours32).max() < 0.05 * scale
    assert (ours16.argmax(-1) == ref.argmax(-1)).mean() > 0.9

    def loss(m, ids):
        return jnp.sum(m(ids)[:, -4:, :8])

    grad = nnx.grad(loss)
    dots = [
        eq
        for eq in _eqns(jax.make_jaxpr(lambda m, i: grad(m, i))(model16, jnp.asarray(ids)).jaxpr)
        if eq.primitive.name == "ragged_dot_general"
    ]
    assert len(dots) >= 6, len(dots)  # 2 forward + 4 backward per stacked layer body
    for eq in dots:
        assert [v.aval.dtype for v in eq.invars[:2]] == [jnp.bfloat16] * 2, eq
        assert eq.outvars[0].aval.dtype == jnp.float32, eq
    g16, g32 = (nnx.jit(grad)(m, jnp.asarray(ids)) for m in (model16, model))
    for name in ("gate_up_proj", "down_proj"):
        a = np.asarray(g16["blocks"]["layers"][0]["mlp"][name][...])
        b = np.asarray(g32["blocks"]["layers"][0]["mlp"][name][...])
        assert a.dtype == np.float32
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        print(f"bf16 {name} gradient relative error {rel:.4f}")
        assert rel < 0.05, (name, rel)
