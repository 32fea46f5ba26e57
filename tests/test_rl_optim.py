"""AdamW from config against a NumPy AdamW written here; schedules against their formulas."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.rl import OptimizerConfig, learning_rate_schedule, make_optimizer


def np_adamw(p, grads, lrs, b1, b2, eps, wd, clip):
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, (g, lr) in enumerate(zip(grads, lrs), 1):
        norm = np.sqrt((g**2).sum())
        if clip is not None and norm > clip:
            g = g * clip / norm
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        mhat, vhat = m / (1 - b1**t), v / (1 - b2**t)
        p = p - lr * (mhat / (np.sqrt(vhat) + eps) + wd * p)
    return p


def test_adamw_with_clipping_and_decay_matches_numpy():
    cfg = OptimizerConfig(
        learning_rate=0.05,
        schedule="linear",
        warmup_steps=2,
        decay_steps=3,
        end_lr_ratio=0.1,
        weight_decay=0.1,
        grad_clip_norm=0.5,
    )
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=(3, 4)).astype(np.float32)
    grads = [rng.normal(size=(3, 4)).astype(np.float32) * s for s in (0.1, 3.0, 1.0, 0.2, 5.0, 0.01)]
    opt = make_optimizer(cfg)
    params = {"w": jnp.asarray(p0)}
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update({"w": jnp.asarray(g)}, state, params)
        params = {"w": params["w"] + updates["w"]}
    sched = learning_rate_schedule(cfg)
    lrs = [float(sched(i)) for i in range(len(grads))]
    want = np_adamw(
        p0.astype(np.float64), [g.astype(np.float64) for g in grads], lrs, 0.9, 0.999, 1e-8, 0.1, 0.5
    )
    np.testing.assert_allclose(np.asarray(params["w"]), want, rtol=1e-5, atol=1e-6)


def test_schedules_follow_their_formulas():
    warm = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=4))
    assert [float(warm(i)) for i in (0, 2, 4, 100)] == [0.0, 0.5, 1.0, 1.0]
    cos = learning_rate_schedule(
        OptimizerConfig(learning_rate=2.0, schedule="cosine", decay_steps=10, end_lr_ratio=0.5)
    )
    for i in (0, 3, 10):
        want = 2.0 * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi * i / 10)))
        assert float(cos(i)) == pytest.approx(want, rel=1e-6)
    const = learning_rate_schedule(OptimizerConfig())
    assert float(const(12345)) == pytest.approx(1e-6)


def test_bad_optimizer_config_raises():
    with pytest.raises(ConfigError, match="decay_steps"):
        OptimizerConfig(schedule="cosine")
    with pytest.raises(ConfigError, match="grad_clip_norm"):
        OptimizerConfig(grad_clip_norm=0.0)
