"""The curriculum (train/curriculum.py): soft filtering of saturated prompts and active sampling."""

import numpy as np
import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.train.config import CurriculumConfig
from tmax_jax.train.curriculum import ActiveSampler, Curriculum, informative


def test_saturated_prompts_are_down_weighted_then_retired():
    cur = Curriculum(
        4, CurriculumConfig(enabled=True, window=3, min_groups=2, saturated_weight=0.25, retire_after=3)
    )
    cur.record(0, 1.0)
    assert not cur.saturated(0)  # one group is not enough evidence
    cur.record(0, 1.0)
    cur.record(1, 0.0)
    cur.record(1, 0.0)
    cur.record(2, 0.5)
    cur.record(2, 1.0)
    assert cur.saturated(0) and cur.saturated(1) and not cur.saturated(2) and not cur.saturated(3)
    np.testing.assert_allclose(cur.weights(), [0.25, 0.25, 1.0, 1.0])
    cur.record(0, 1.0)  # third saturated group in a row: retired
    assert cur.retired == {0}
    np.testing.assert_allclose(cur.weights(), [0.0, 0.25, 1.0, 1.0])
    # A mixed group breaks prompt 1's streak and brings its recent rate off 0.
    cur.record(1, 0.5)
    assert cur.streak[1] == 0 and not cur.saturated(1)
    assert cur.recent_pass_rate(1) == pytest.approx(1 / 6)


def test_window_forgets_old_groups():
    cur = Curriculum(1, CurriculumConfig(window=2, min_groups=2))
    for r in (0.5, 0.0, 0.0):
        cur.record(0, r)
    assert cur.history[0] == [0.0, 0.0] and cur.saturated(0)


def test_sampling_follows_the_weights_and_never_draws_retired():
    cur = Curriculum(3, CurriculumConfig(window=2, min_groups=2, saturated_weight=0.1, retire_after=2))
    for _ in range(2):
        cur.record(0, 1.0)  # retired
        cur.record(1, 0.0)  # retired
    cur.retired.discard(1)  # prompt 1 only saturated: weight 0.1 vs prompt 2's 1.0
    rng = np.random.default_rng(0)
    counts = np.zeros(3)
    for _ in range(4000):
        counts[cur.sample(rng, 1)] += 1
    assert counts[0] == 0
    assert counts[1] / counts.sum() == pytest.approx(0.1 / 1.1, abs=0.02)
    # Two prompts asked for, only prompts 1 and 2 live: both, distinct.
    assert sorted(cur.sample(rng, 2)) == [1, 2]
    # Three asked for: the retired one fills the gap.
    assert sorted(cur.sample(rng, 3)) == [0, 1, 2]


def test_everything_retired_brings_everything_back():
    cur = Curriculum(2, CurriculumConfig(window=1, min_groups=1, saturated_weight=0.0, retire_after=1))
    cur.record(0, 1.0)
    cur.record(1, 0.0)
    np.testing.assert_allclose(cur.weights(), [1.0, 1.0])
    assert cur.retired == set()


def test_state_round_trip_and_mismatch():
    cfg = CurriculumConfig(window=3, min_groups=1, retire_after=1)
    a = Curriculum(3, cfg)
    a.record(0, 1.0)
    a.record(2, 0.25)
    b = Curriculum(3, cfg)
    b.load_state_dict(a.state_dict())
    assert b.history == a.history and b.retired == {0} and b.streak == a.streak
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    assert a.sample(rng_a, 2) == b.sample(rng_b, 2)
    with pytest.raises(ConfigError, match="3 prompts, this run has 4"):
        Curriculum(4, cfg).load_state_dict(a.state_dict())


def test_bad_records_and_config():
    cur = Curriculum(2, CurriculumConfig())
    with pytest.raises(IndexError):
        cur.record(2, 0.5)
    with pytest.raises(ValueError, match="pass rate"):
        cur.record(0, 1.5)
    with pytest.raises(ConfigError, match="min_groups"):
        CurriculumConfig(window=2, min_groups=3)
    with pytest.raises(ConfigError, match="saturated_weight"):
        CurriculumConfig(saturated_weight=2.0)


def test_informative():
    assert informative([0.0, 1.0]) and informative([0.2, 0.2, 0.3])
    assert not informative([1.0, 1.0]) and not informative([0.0]) and not informative([])


def _runner(rewards_of):
    """A run_groups that gives prompt p the rewards rewards_of[p] (the group is the prompt id)."""
    calls = []

    def run(prompts, draw):
        calls.append((list(prompts), draw))
        return [(p, rewards_of[p], float(np.mean(rewards_of[p]))) for p in prompts]

    return run, calls


def test_active_sampling_draws_until_enough_informative_groups():
    # Prompts 0-5 always pass or always fail, 6 and 7 are mixed: a step needs 2 informative groups.
    rewards_of = {p: [1.0, 1.0] if p % 2 else [0.0, 0.0] for p in range(6)}
    rewards_of.update({6: [0.0, 1.0], 7: [1.0, 0.0]})
    cur = Curriculum(8, CurriculumConfig(window=4, min_groups=1, saturated_weight=0.0, max_draws=10))
    sampler = ActiveSampler(cur, 2, seed=0)
    run, calls = _runner(rewards_of)
    groups, m = sampler.step(0, run)
    assert sorted(g for g in groups if g >= 6) == [6, 7]
    assert m["curriculum/informative_groups"] == 2 and m["curriculum/short"] == 0
    assert m["curriculum/draws"] == len(calls) and m["curriculum/groups_drawn"] == 2 * len(calls)
    assert m["curriculum/flat_groups"] == len(groups) - 2
    assert [d for _, d in calls] == list(range(len(calls)))
    # Every flat prompt seen is now saturated with weight 0: the next step draws only 6 and 7.
    run2, calls2 = _runner(rewards_of)
    groups2, m2 = sampler.step(1, run2)
    seen_flat = {p for ps, _ in calls for p in ps if p < 6}
    assert all(p not in seen_flat for ps, _ in calls2 for p in ps)
    assert m2["curriculum/saturated_prompts"] >= len(seen_flat)


def test_active_sampling_is_bounded_and_counts_the_shortfall():
    rewards_of = {p: [1.0, 1.0] for p in range(5)}
    cur = Curriculum(5, CurriculumConfig(max_draws=3))
    run, calls = _runner(rewards_of)
    groups, m = ActiveSampler(cur, 2, seed=1).step(0, run)
    assert len(calls) == 3 and m["curriculum/draws"] == 3 and m["curriculum/short"] == 1
    assert m["curriculum/informative_groups"] == 0 and len(groups) == 6


def test_active_sampling_keeps_at_most_k_informative():
    rewards_of = {p: [0.0, 1.0] for p in range(6)}
    cur = Curriculum(6, CurriculumConfig(max_draws=3))
    run, _ = _runner(rewards_of)
    groups, m = ActiveSampler(cur, 3, seed=2).step(4, run)
    assert len(groups) == 3 and m["curriculum/draws"] == 1 and m["curriculum/extra_informative_dropped"] == 0


def test_draws_are_reproducible_per_step():
    cfg = CurriculumConfig()
    a = ActiveSampler(Curriculum(20, cfg), 4, seed=3)
    b = ActiveSampler(Curriculum(20, cfg), 4, seed=3)
    assert a.curriculum.sample(a.rng(7, 0), 4) == b.curriculum.sample(b.rng(7, 0), 4)
    assert a.curriculum.sample(a.rng(7, 0), 4) != a.curriculum.sample(a.rng(8, 0), 4)


def test_processes_draw_from_disjoint_shards():
    cur = Curriculum(10, CurriculumConfig())
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = cur.sample(rng, 3, (0, 2)), cur.sample(rng, 3, (1, 2))
        assert all(i % 2 == 0 for i in a) and all(i % 2 == 1 for i in b)
        assert len(set(a)) == 3 and len(set(b)) == 3
    assert sorted(cur.sample(rng, 9, (1, 3))) == [1, 4, 7]
