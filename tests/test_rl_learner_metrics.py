"""Mismatch vs staleness through the real train step: the ``policy_lag`` field built from packed
trajectories, and same-version tokens that show only the engine/trainer numerics gap."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.rl import OptimizerConfig, RLConfig
from tmax_jax.rl.packing import pack_trajectories
from tmax_jax.rl.train_step import LAG_FIELD, TrainStep, make_model, policy_lag, with_lag_field
from tmax_jax.sharding import MeshConfig, make_mesh

SEQ, ROWS = 40, 4


def trajectories(seed=0, n=6):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(8, 20))
        mask = np.zeros(L, int)
        mask[L // 3 :] = 1
        versions = np.where(mask > 0, 7 - (i % 3), -1)  # sampled at versions 7, 6, 5
        out.append(
            SimpleNamespace(
                tokens=rng.integers(0, 256, L).tolist(),
                response_mask=mask.tolist(),
                rollout_logprobs=[0.0] * L,
                policy_versions=versions.tolist(),
            )
        )
    return out


def test_policy_lag_field_follows_the_packing():
    trajs = trajectories()
    batch, placement = pack_trajectories(trajs, [1.0] * len(trajs), seq_len=SEQ, num_rows=ROWS)
    lag = policy_lag(trajs, placement, batch["input_ids"].shape, learner_version=7)
    assert lag.dtype == np.int32 and lag.shape == (ROWS, SEQ)
    want = np.full((ROWS, SEQ), -1)
    for t, (row, start, n) in zip(trajs, placement):
        for j in range(n):  # target j is token j + 1
            if t.response_mask[j + 1]:
                want[row, start + j] = 7 - t.policy_versions[j + 1]
    np.testing.assert_array_equal(lag, want)
    assert set(np.unique(lag)) == {-1, 0, 1, 2}
    assert np.all((lag >= 0) == (batch["response_mask"] > 0))
    with pytest.raises(Exception, match="policy_lag"):
        with_lag_field({**batch, LAG_FIELD: lag.astype(np.float32)})


def test_same_version_tokens_show_numerics_only_and_stale_ones_show_staleness():
    trajs = trajectories(1)
    batch, placement = pack_trajectories(trajs, [1.0, -1.0] * 3, seq_len=SEQ, num_rows=ROWS)
    model = make_model(Qwen35Config.preset("tiny"), remat="none", seed=0)
    logits = model(
        jnp.asarray(batch["input_ids"]),
        positions=jnp.asarray(batch["positions"]),
        segment_ids=jnp.asarray(batch["segment_ids"]),
    )
    own = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)), batch["targets"][..., None], -1)[
        ..., 0
    ]
    lag = policy_lag(trajs, placement, batch["input_ids"].shape, learner_version=7)
    # Same-version tokens carry the model's own logprobs; stale ones a policy 0.3 nats away.
    batch["rollout_logprobs"] = np.where(lag > 0, own - 0.3, own).astype(np.float32) * batch["response_mask"]
    batch[LAG_FIELD] = lag
    cfg = MeshConfig(data=1, fsdp=1, tensor=1)
    rl = RLConfig(optimizer=OptimizerConfig(learning_rate=1e-3))
    step = TrainStep(model, rl, make_mesh(cfg, jax.devices()[:1]), cfg)
    _, m = step(step.init_state(), batch)
    m = {k: float(v) for k, v in m.items()}
    known = (lag >= 0).sum()
    assert m["mismatch/tokens"] == (lag == 0).sum() > 0
    assert m["mismatch/max_abs_logprob_diff"] < 1e-5 and m["mismatch/kl"] < 1e-9
    np.testing.assert_allclose(m["max_abs_logprob_diff"], 0.3, rtol=1e-4)  # the mixed number sees staleness
    np.testing.assert_allclose(m["staleness/off_policy_fraction"], (lag > 0).sum() / known, rtol=1e-6)
    np.testing.assert_allclose(m["staleness/lag_2_fraction"], (lag == 2).sum() / known, rtol=1e-6)
    np.testing.assert_allclose(m["staleness/lag_3+_fraction"], 0.0)
