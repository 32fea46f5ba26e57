"""Packing trajectories into rows: layout, and packed segments score exactly like unpacked ones."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.rl import token_logprobs
from tmax_jax.rl.packing import pack_trajectories, validate_batch
from tmax_jax.rl.train_step import make_model


def traj(tokens, mask, lps):
    return SimpleNamespace(tokens=list(tokens), response_mask=list(mask), rollout_logprobs=list(lps))


def random_trajs(seed, lengths, vocab=512):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        mask = (rng.uniform(size=n) > 0.5).astype(int)
        out.append(traj(rng.integers(1, vocab, n), mask, np.where(mask, -rng.uniform(0, 3, n), 0.0)))
    return out


def test_layout_shifts_targets_and_restarts_positions():
    a = traj([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25])
    b = traj([9, 10, 11], [0, 1, 1], [0.0, -1.0, -2.0])
    batch, placement = pack_trajectories([a, b], [0.5, -1.0], seq_len=6)
    validate_batch(batch)
    assert placement == [(0, 0, 3), (0, 3, 2)]
    np.testing.assert_array_equal(batch["input_ids"], [[5, 6, 7, 9, 10, 0]])
    np.testing.assert_array_equal(batch["targets"], [[6, 7, 8, 10, 11, 0]])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 0, 1, 0]])
    np.testing.assert_array_equal(batch["response_mask"], [[0, 1, 1, 1, 1, 0]])
    np.testing.assert_allclose(batch["rollout_logprobs"], [[0, -0.5, -0.25, -1.0, -2.0, 0]])
    np.testing.assert_allclose(batch["advantages"], [[0.5, 0.5, 0.5, -1.0, -1.0, 0]])


def test_first_fit_decreasing_and_fixed_rows():
    trajs = random_trajs(0, [9, 5, 7, 3, 4])
    batch, placement = pack_trajectories(trajs, [0.0] * 5, seq_len=10, num_rows=4)
    assert batch["input_ids"].shape == (4, 10)
    # Every trajectory's tokens sit in its segment, nothing overlaps.
    used = np.zeros((4, 10), int)
    for tr, (row, start, n) in zip(trajs, placement):
        np.testing.assert_array_equal(batch["input_ids"][row, start : start + n], tr.tokens[:-1])
        used[row, start : start + n] += 1
    assert used.max() == 1 and used.sum() == sum(len(t.tokens) - 1 for t in trajs)
    # Right padding only: once a row pads, it stays padding.
    seg = batch["segment_ids"]
    assert all(np.all(np.diff((r > 0).astype(int)) <= 0) for r in seg)
    batch, _ = pack_trajectories(trajs, [0.0] * 5, seq_len=10, rows_multiple=4)
    assert batch["input_ids"].shape[0] % 4 == 0


def test_packing_errors_name_the_problem():
    with pytest.raises(ConfigError, match="needs 11 positions"):
        pack_trajectories(random_trajs(0, [12]), [0.0], seq_len=10)
    with pytest.raises(ConfigError, match="num_rows is 1"):
        pack_trajectories(random_trajs(0, [9, 9]), [0.0, 0.0], seq_len=10, num_rows=1)
    with pytest.raises(ConfigError, match="lengths differ"):
        pack_trajectories([traj([1, 2, 3], [0, 1], [0, 0, 0])], [0.0], seq_len=10)
    with pytest.raises(ConfigError, match="2 trajectories but 1"):
        pack_trajectories(random_trajs(0, [3, 3]), [0.0], seq_len=10)


def test_packed_segments_give_the_same_logprobs_as_unpacked():
    """Attention, the causal conv and the DeltaNet state must not leak across packed segments."""
    cfg = Qwen35Config.preset("tiny")
    model = make_model(cfg, remat="none", seed=1)
    # Lengths beyond the DeltaNet chunk (64) so segment starts fall inside and across chunks.
    trajs = random_trajs(3, [40, 70, 23, 9])
    packed, placement = pack_trajectories(trajs, [0.0] * 4, seq_len=160, num_rows=1)
    assert len({row for row, _, _ in placement}) == 1  # all four share one row

    @jax.jit
    def score(input_ids, positions, segment_ids, targets):
        hidden = model.hidden_states(input_ids, positions=positions, segment_ids=segment_ids)
        return token_logprobs(hidden, model.lm_head_weight(), targets, chunk_size=32)

    lp_packed = np.asarray(
        score(*(jnp.asarray(packed[k]) for k in ("input_ids", "positions", "segment_ids", "targets")))
    )
    # Unpacked: each trajectory alone in its own (right-padded) row.
    alone, _ = pack_trajectories(trajs, [0.0] * 4, seq_len=160, num_rows=4)
    single = {k: np.zeros_like(alone[k]) for k in alone}
    for i, tr in enumerate(trajs):
        b, _ = pack_trajectories([tr], [0.0], seq_len=160)
        for k in single:
            single[k][i] = b[k][0]
    lp_alone = np.asarray(
        score(*(jnp.asarray(single[k]) for k in ("input_ids", "positions", "segment_ids", "targets")))
    )
    for i, (row, start, n) in enumerate(placement):
        np.testing.assert_allclose(lp_packed[row, start : start + n], lp_alone[i, :n], rtol=1e-5, atol=2e-5)
    # The reference really differs when segments are wrongly merged into one sequence.
    merged = np.where(packed["segment_ids"] > 0, 1, 0).astype(np.int32)
    lp_merged = np.asarray(
        score(
            *(jnp.asarray(x) for x in (packed["input_ids"], packed["positions"], merged, packed["targets"]))
        )
    )
    row, start, n = placement[1] if placement[1][1] > 0 else placement[0]
    assert np.abs(lp_merged[row, start : start + n] - lp_packed[row, start : start + n]).max() > 1e-3
