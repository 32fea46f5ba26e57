"""The sharded train step on the tiny Qwen 3.5: 8 fake CPU devices == 1 device, and it learns."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.rl import OptimizerConfig, RLConfig, TrainStepConfig
from tmax_jax.rl.packing import pack_trajectories
from tmax_jax.rl.train_step import TrainStep, make_model
from tmax_jax.sharding import MeshConfig, make_mesh

SEQ, ROWS = 48, 8


def tiny_cfg():
    return Qwen35Config.preset("tiny")


def on_policy_batch(seed=0):
    """Packed random trajectories whose rollout logprobs are the model's own (r = 1 before a step)."""
    rng = np.random.default_rng(seed)
    trajs, adv = [], []
    for i in range(14):
        n = int(rng.integers(8, 30))
        mask = np.zeros(n, int)
        mask[n // 3 :] = rng.uniform(size=n - n // 3) > 0.2  # prompt, then mostly generated tokens
        trajs.append(
            SimpleNamespace(
                tokens=rng.integers(0, 512, n).tolist(),
                response_mask=mask.tolist(),
                rollout_logprobs=[0.0] * n,
            )
        )
        adv.append(1.0 if i % 2 else -1.0)
    batch, _ = pack_trajectories(trajs, adv, seq_len=SEQ, num_rows=ROWS)
    model = make_model(tiny_cfg(), remat="none", seed=0)
    logits = model(
        jnp.asarray(batch["input_ids"]),
        positions=jnp.asarray(batch["positions"]),
        segment_ids=jnp.asarray(batch["segment_ids"]),
    )
    lp = jax.nn.log_softmax(logits, axis=-1)
    picked = np.take_along_axis(np.asarray(lp), batch["targets"][..., None], -1)[..., 0]
    batch["rollout_logprobs"] = (picked * batch["response_mask"]).astype(np.float32)
    return batch


RL = RLConfig(optimizer=OptimizerConfig(learning_rate=3e-3, grad_clip_norm=1.0, weight_decay=0.01))


@pytest.fixture(scope="module")
def batch():
    return on_policy_batch()


@pytest.fixture(scope="module")
def step8():
    """fsdp=4 x tensor=2 over 8 fake devices, two micro-batches of gradient accumulation."""
    cfg = MeshConfig(data=1, fsdp=4, tensor=2)
    rl = RLConfig(optimizer=RL.optimizer, train_step=TrainStepConfig(micro_batches=2))
    return TrainStep(make_model(tiny_cfg(), remat="full", seed=0), rl, make_mesh(cfg), cfg)


@pytest.fixture(scope="module")
def step1():
    cfg = MeshConfig(data=1, fsdp=1, tensor=1)
    return TrainStep(make_model(tiny_cfg(), remat="none", seed=0), RL, make_mesh(cfg, jax.devices()[:1]), cfg)


def params_np(state):
    return {
        "/".join(map(str, p)): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state.params)
    }


def test_params_and_adam_state_are_sharded_by_the_rules(step8):
    assert len(jax.devices()) == 8
    state = step8.init_state(_fresh_params())
    emb = state.params["embed_tokens"].get_value()
    assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")  # vocab -> tensor, embed -> fsdp
    assert emb.addressable_shards[0].data.shape == (512 // 2, 64 // 4)
    mu = state.opt_state[1][0].mu
    nu = state.opt_state[1][0].nu
    for (path, p), m, v in zip(
        jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(mu), jax.tree.leaves(nu)
    ):
        assert m.sharding == p.sharding and v.sharding == p.sharding, path
        assert m.shape == p.shape
    sharded = [p for p in jax.tree.leaves(state.params) if any(s is not None for s in p.sharding.spec)]
    assert len(sharded) >= len(jax.tree.leaves(state.params)) // 2


def test_eight_devices_match_one_device(step8, step1, batch):
    s8, m8 = step8(step8.init_state(_fresh_params()), batch)
    s1, m1 = step1(step1.init_state(_fresh_params()), batch)
    # Before the update the trainer's logprobs equal the engine-style reference: r == 1, nothing masked.
    for m in (m8, m1):
        np.testing.assert_allclose(float(m["ratio_mean"]), 1.0, atol=1e-5)
        assert float(m["masked_fraction"]) == 0.0
        assert float(m["max_abs_logprob_diff"]) < 1e-4
    np.testing.assert_allclose(float(m8["loss"]), float(m1["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m8["grad_norm"]), float(m1["grad_norm"]), rtol=1e-4)
    p8, p1 = params_np(s8), params_np(s1)
    assert p8.keys() == p1.keys()
    # Adam's first step is ~ lr * sign(g): an element whose gradient is near zero moves anywhere in
    # [-lr, lr] on rounding alone when the shards sum in another order (CI saw 1 of 8192 elements of
    # a leaf off by 2.0e-4). So: every element within lr / 30, except at most 0.1% of a leaf, and
    # those within the 2 lr any single Adam step allows. A wrong reduction or a lost shard moves
    # far more elements than that.
    lr = RL.optimizer.learning_rate
    for k in p1:
        off = np.abs(p8[k] - p1[k]) > 1e-4 + 1e-4 * np.abs(p1[k])
        assert off.sum() <= max(1, off.size // 1000), (k, int(off.sum()), off.size)
        np.testing.assert_allclose(p8[k], p1[k], atol=2 * lr, err_msg=k)
    assert int(s8.step) == int(s1.step) == 1
    # The update really moved the weights (so the comparison above is not vacuous).
    p0 = {
        "/".join(map(str, p)): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(_fresh_params())
    }
    assert max(np.abs(p1[k] - p0[k]).max() for k in p1) > 1e-3


def test_a_few_steps_reduce_the_loss(step1, batch):
    state = step1.init_state(_fresh_params())
    losses = []
    for _ in range(4):
        state, metrics = step1(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 1e-3, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def _fresh_params():
    from flax import nnx

    return nnx.state(make_model(tiny_cfg(), remat="none", seed=0), nnx.Param)


def test_bad_batches_are_rejected(step1, batch):
    from tmax_jax.errors import ConfigError

    bad = dict(batch)
    bad["targets"] = bad["targets"].astype(np.int64)
    with pytest.raises(ConfigError, match="targets"):
        step1.put_batch(bad)
    with pytest.raises(ConfigError, match="missing"):
        step1.put_batch({k: v for k, v in batch.items() if k != "advantages"})
