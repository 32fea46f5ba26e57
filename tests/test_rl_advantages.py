"""Group-centred advantages and soft filtering, against a direct NumPy computation."""

import numpy as np
import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.rl import AdvantageConfig, group_advantages


def test_centered_advantages_and_soft_filtering():
    rewards = [1.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0, 0.2, 0.8]
    groups = ["a", "a", "a", "a", "b", "b", "b", "c", "c", "d", "d"]
    out = group_advantages(rewards, groups)
    r = np.array(rewards)
    want = np.zeros_like(r)
    for g in ("a", "d"):
        idx = [i for i, x in enumerate(groups) if x == g]
        want[idx] = r[idx] - r[idx].mean()
    np.testing.assert_allclose(out.advantages, want, rtol=1e-6)
    assert out.advantages.dtype == np.float32
    assert out.keep.tolist() == [True] * 4 + [False] * 5 + [True] * 2
    assert out.dropped_groups == ("b", "c")
    assert out.zero_pass_groups == ("b",)
    assert out.all_pass_groups == ("c",)
    stats = out.stats()
    assert stats["groups"] == 4 and stats["groups_dropped"] == 2 and stats["trajectories_kept"] == 6


def test_std_mode_divides_by_group_std():
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 3.0, 1.0])
    groups = [0, 0, 0, 0, 1, 1]
    out = group_advantages(rewards, groups, AdvantageConfig(mode="std", std_eps=0.0))
    for g in (0, 1):
        idx = np.array(groups) == g
        rg = rewards[idx]
        np.testing.assert_allclose(out.advantages[idx], (rg - rg.mean()) / rg.std(), rtol=1e-6)


def test_keeping_constant_groups_when_asked():
    out = group_advantages([1.0, 1.0], [0, 0], AdvantageConfig(drop_constant_groups=False))
    assert out.keep.all() and np.all(out.advantages == 0)


def test_bad_inputs_raise():
    with pytest.raises(ConfigError, match="group_ids has 1 entries"):
        group_advantages([1.0, 0.0], [0])
    with pytest.raises(ConfigError, match="finite"):
        group_advantages([np.nan, 0.0], [0, 0])
    with pytest.raises(ConfigError, match="1-D"):
        group_advantages([[1.0]], [0])
