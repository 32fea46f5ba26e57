"""Mismatch vs staleness through the real train step: the ``policy_lag`` field built from packed
trajectories, and same-version tokens that show only the engine/trainer numerics gap."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tmax_jax.engine import Engine, SamplingParams
from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.rl import OptimizerConfig, RLConfig
from tmax_jax.rl.logprobs import token_logprobs
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


def _engine_episode(engine, prompt, before, after, new_params=None):
    """``before`` tokens, then (``new_params``: an in-flight update to version 1) ``after`` more, all
    decoded on one cache; the trajectory with the engine's logprobs and the versions that sampled them."""
    padded = np.zeros((16,), np.int32)
    padded[: len(prompt)] = prompt
    params = engine.load_params()
    sp = SamplingParams(temperature=1.0, seed=5)
    prefix, first = engine.prefill(
        params=params, padded_tokens=jnp.asarray(padded), true_length=len(prompt), sampling_params=sp
    )
    toks, lps = [int(np.asarray(first.data)[0, 0])], [float(np.asarray(first.log_prob)[0, 0])]
    versions = [engine.version]
    state = engine.insert(prefix, engine.init_decode_state(), 0)
    for _ in range(before + after - 1):
        if new_params is not None and len(toks) == before:
            engine.update_params(new_params, version=1)
        state, res = engine.generate(engine.load_params(), state)
        toks.append(int(np.asarray(res.data)[0, 0]))
        lps.append(float(np.asarray(res.log_prob)[0, 0]))
        versions.append(engine.version)
    n = len(prompt)
    return SimpleNamespace(
        tokens=[*map(int, prompt), *toks],
        response_mask=[0] * n + [1] * len(toks),
        rollout_logprobs=[0.0] * n + lps,
        policy_versions=[-1] * n + versions,
    )


def test_tokens_decoded_after_an_in_flight_update_are_not_same_version():
    """A weight update between decode steps leaves the earlier tokens' cache from the old policy, so
    the tokens sampled after it are not the new policy's own distribution: the trainer (new weights
    over the whole context) disagrees with the engine far beyond numerics. ``policy_lag`` counts
    them as lagging (staleness) rather than same-version (mismatch); an episode decoded wholly after
    the update matches to float32 numerics and has lag 0."""
    old, new = (make_model(Qwen35Config.preset("tiny"), remat="none", seed=s) for s in (0, 1))
    engine = Engine(old, max_concurrent_decodes=1, max_cache_length=64, max_prefill_length=16)
    prompt = np.asarray([3, 1, 4, 1, 5, 9, 2], np.int32)
    mixed = _engine_episode(engine, prompt, 4, 4, new_params=nnx.state(new))
    clean = _engine_episode(engine, prompt, 4, 4)  # the engine now holds version 1 from the start
    assert mixed.policy_versions[-8:] == [0] * 4 + [1] * 4 and clean.policy_versions[-8:] == [1] * 8
    gaps = []
    for tr in (mixed, clean):
        seq = jnp.asarray([tr.tokens], jnp.int32)
        trainer = token_logprobs(
            new.hidden_states(seq[:, :-1]), new.lm_head_weight(), seq[:, 1:], temperature=1.0
        )
        gaps.append(np.abs(np.asarray(trainer)[0, -4:] - np.asarray(tr.rollout_logprobs[-4:])).max())
    assert gaps[0] > 1e-2 and gaps[1] < 1e-5, gaps  # stale cache vs numerics
    batch, placement = pack_trajectories([mixed, clean], [1.0, 1.0], seq_len=SEQ, num_rows=2)
    lag = policy_lag([mixed, clean], placement, batch["input_ids"].shape, learner_version=1)
    (r0, s0, n0), (r1, s1, n1) = placement
    np.testing.assert_array_equal(
        lag[r0, s0 + n0 - 8 : s0 + n0], [1] * 8
    )  # v0 tokens and v1 tokens on v0 cache
    np.testing.assert_array_equal(lag[r1, s1 + n1 - 8 : s1 + n1], [0] * 8)
