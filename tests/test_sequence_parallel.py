"""Sequence parallelism (the ``sequence`` rule, sharding.py) on 8 fake CPU devices: the residual
stream split over the tensor axis by tokens gives the unsharded loss and gradients, and really shrinks
what each device holds."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tmax_jax.errors import ConfigError
from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.rl.config import LossConfig
from tmax_jax.rl.train_step import batch_loss, make_model
from tmax_jax.sharding import (
    BATCH_AXES,
    DEFAULT_RULES,
    MeshConfig,
    batch_sharding,
    gather_tokens,
    make_mesh,
    param_shardings,
    shard_tokens,
    shard_tree,
)

NO_SP = tuple((k, None if k == "sequence" else v) for k, v in DEFAULT_RULES)


def sp_cfg() -> Qwen35Config:
    """The tiny preset with every head count divisible by 4 (tensor=4 splits each mixer's heads) and
    the chunked delta rule spanning several chunks."""
    return dataclasses.replace(
        Qwen35Config.preset("tiny"),
        num_attention_heads=8,
        num_key_value_heads=4,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        chunk_size=16,
    )


def packed_batch(rows: int, T: int, seed: int = 0) -> dict:
    """Random rows of several packed segments each, with pads at the end of some rows."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, T), np.int32)
    pos = np.zeros((rows, T), np.int32)
    for r in range(rows):
        t, s = 0, 1
        while t < T - 4 * (r % 2):
            n = min(int(rng.integers(5, T // 2)), T - t)
            seg[r, t : t + n], pos[r, t : t + n] = s, np.arange(n)
            t, s = t + n, s + 1
    valid = seg > 0
    return {
        "input_ids": rng.integers(0, 512, (rows, T)).astype(np.int32),
        "segment_ids": seg,
        "positions": pos,
        "targets": rng.integers(0, 512, (rows, T)).astype(np.int32),
        "response_mask": (valid & (rng.uniform(size=(rows, T)) > 0.3)).astype(np.float32),
        "rollout_logprobs": np.where(valid, -rng.uniform(1, 8, (rows, T)), 0).astype(np.float32),
        "advantages": np.where(valid, rng.normal(size=(rows, 1)), 0).astype(np.float32),
    }


LOSS = LossConfig(name="ppo_clip", clip_eps=10.0)  # a smooth objective: no mask flips on rounding


def loss_and_grads(model, mesh, mesh_cfg, batch, rules=DEFAULT_RULES, run=True):
    """(loss, {path: gradient}, the compiled step); ``run`` False: the compiled step only (None, None)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    psh = param_shardings(params, mesh, mesh_cfg)
    hidden = NamedSharding(mesh, P(BATCH_AXES, None, None))

    def f(p, mb):
        def loss(p):
            return batch_loss(nnx.merge(graphdef, p, rest), mb, LOSS, 100.0, hidden_sharding=hidden)[0]

        return jax.value_and_grad(loss)(p)

    bsh = {k: batch_sharding(mesh, 2) for k in batch}
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        fn = jax.jit(f, in_shardings=(psh, bsh))
        args = shard_tree((params, batch), (psh, bsh))
        compiled = fn.lower(*args).compile()
        if not run:
            return None, None, compiled
        loss, grads = compiled(*args)
    flat = {"/".join(map(str, p)): np.asarray(g) for p, g in jax.tree_util.tree_leaves_with_path(grads)}
    return float(loss), flat, compiled


@pytest.fixture(scope="module")
def reference():
    """Loss and gradients of the whole batch on one device."""
    batch = packed_batch(4, 64)
    model = make_model(sp_cfg(), remat="none", seed=0)
    one = MeshConfig(data=1, fsdp=1, tensor=1)
    loss, grads, _ = loss_and_grads(model, make_mesh(one, jax.devices()[:1]), one, batch)
    return batch, loss, grads


@pytest.mark.parametrize(
    "mesh_cfg, remat",
    [
        (MeshConfig(data=1, fsdp=4, tensor=2), "full"),
        (MeshConfig(data=1, fsdp=2, tensor=4), "full"),
        (MeshConfig(data=2, fsdp=1, tensor=4), "none"),
    ],
    ids=["fsdp4-tensor2-full", "fsdp2-tensor4-full", "data2-tensor4-none"],
)
def test_sequence_parallel_loss_and_grads_match_one_device(reference, mesh_cfg, remat):
    """With remat="full" the MLP and the mixers' token-wise stages run in 16-token chunks (4 per row),
    so their own backward passes run under the mesh too."""
    from tmax_jax.models.qwen35.attention import GatedAttention
    from tmax_jax.models.qwen35.deltanet import GatedDeltaNet
    from tmax_jax.models.qwen35.mlp import SwiGLU

    batch, loss1, grads1 = reference
    model = make_model(sp_cfg(), remat=remat, seed=0)
    if remat == "full":
        for _, m in nnx.iter_graph(model):
            if isinstance(m, SwiGLU):
                m.chunk = 16
            if isinstance(m, (GatedAttention, GatedDeltaNet)):
                m.token_chunk = 16
    loss, grads, compiled = loss_and_grads(model, make_mesh(mesh_cfg), mesh_cfg, batch)
    np.testing.assert_allclose(loss, loss1, rtol=1e-5)
    assert grads.keys() == grads1.keys()
    # Within float32 rounding of a reordered sum: the delta rule's gate gradients (A_log, dt_bias)
    # cancel over tokens, and plain tensor parallelism (the sequence rule off) already moves them by
    # up to 3.7e-4 of the leaf's largest element on these meshes; a lost or doubled shard moves
    # every element by O(1) of it.
    for k, g1 in grads1.items():
        scale = np.abs(g1).max()
        assert scale > 0, k
        np.testing.assert_allclose(grads[k], g1, rtol=1e-3, atol=1e-3 * scale, err_msg=k)
    # The residual stream really travels split: the projections' partial sums are reduce-scattered
    # (XLA's CPU pipeline may spell it as an all-reduce plus a slice, so either is accepted) and the
    # normed tokens all-gathered.
    hlo = compiled.as_text()
    assert "all-gather" in hlo


def test_sequence_rule_splits_the_saved_hidden_states():
    """The layer scan saves each period's input for the backward pass: with the rule, each device
    holds its quarter of the tokens (f32[periods, rows, T/4, D]), without it the whole row, and
    the compiled step's temporaries shrink with it. Three periods: a scan (two are unrolled)."""
    cfg = dataclasses.replace(
        sp_cfg(),
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=12,
        layer_types=sp_cfg().layer_types * 3,
    )
    mesh_cfg = MeshConfig(data=1, fsdp=2, tensor=4)
    model = make_model(cfg, remat="full", seed=0)
    batch, T = packed_batch(2, 512), 512
    compiled = {
        name: loss_and_grads(model, make_mesh(mesh_cfg), mesh_cfg, batch, rules, run=False)[2]
        for name, rules in (("sp", DEFAULT_RULES), ("off", NO_SP))
    }
    split, whole = f"f32[3,1,{T // 4},256]", f"f32[3,1,{T},256]"
    assert split in compiled["sp"].as_text() and whole not in compiled["sp"].as_text()
    assert whole in compiled["off"].as_text()
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    assert temp["sp"] < 0.9 * temp["off"], temp


def test_constraints_are_no_ops_off_mesh_and_when_t_does_not_divide():
    x = jnp.ones((2, 6, 4))
    assert shard_tokens(x) is x and gather_tokens(x) is x  # no ambient mesh
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))

    @jax.jit
    def f(x):
        return shard_tokens(x) * 2

    def spec(a):
        return tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))

    with jax.set_mesh(mesh):
        # T=6 over tensor=4: the token split is dropped (as fit_spec drops it for parameters).
        assert spec(f(jnp.ones((2, 6, 4)))) == ("fsdp", None, None)
        assert spec(f(jnp.ones((2, 8, 4)))) == ("fsdp", "tensor", None)
        with nnx.logical_axis_rules(NO_SP):
            # Rules are read when a function is traced: a fresh one (f's trace at this shape is cached).
            assert "tensor" not in spec(jax.jit(lambda x: shard_tokens(x) * 2)(jnp.ones((2, 8, 4))))


def test_sequence_cannot_map_to_a_batch_axis():
    rules = tuple((k, "fsdp" if k == "sequence" else v) for k, v in DEFAULT_RULES)
    with pytest.raises(ConfigError, match="'sequence' maps to 'fsdp'"):
        MeshConfig(rules=rules)


@pytest.mark.parametrize("rules, want", [(DEFAULT_RULES, "tensor"), (NO_SP, None)], ids=["default", "off"])
def test_train_step_traces_the_model_under_its_mesh_rules(monkeypatch, rules, want):
    """A ``mesh.rules`` override reaches the model: TrainStep traces its step under the rules of its
    MeshConfig, so the sequence split the model applies is the configured one, not DEFAULT_RULES."""
    from tmax_jax import sharding
    from tmax_jax.rl import OptimizerConfig, RLConfig
    from tmax_jax.rl.train_step import TrainStep

    seen = []
    real = sharding.sequence_axis

    def spy(rules=None):
        seen.append(real(rules))
        return seen[-1]

    monkeypatch.setattr(sharding, "sequence_axis", spy)
    mesh_cfg = MeshConfig(data=1, fsdp=4, tensor=2, rules=rules)
    rl = RLConfig(loss=LOSS, optimizer=OptimizerConfig(learning_rate=1e-3))
    step = TrainStep(make_model(sp_cfg(), remat="none", seed=0), rl, make_mesh(mesh_cfg), mesh_cfg)
    state, metrics = step(step.init_state(), packed_batch(4, 64))
    assert np.isfinite(float(metrics["loss"]))
    assert seen and set(seen) == {want}, seen
