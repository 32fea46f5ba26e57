"""The reward contract (tmax_jax/tasks/reward.py) and the advantages' refusal of non-finite values.

Expected values are written out from the contract in reward.py's docstring; the range rule ([0, 1] as
is, within 1e-6 clamped, else an error) and the advantages are checked against NumPy float64.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.rl import group_advantages
from tmax_jax.rl.advantages import NonFiniteAdvantageError
from tmax_jax.tasks.reward import MAX_TXT_BYTES, REWARD_TOLERANCE, RewardReading, parse_reward

TXT_OK = [
    (b"1", 1.0, None),
    (b"0", 0.0, None),
    (b"0.25\n", 0.25, None),
    (b"  \t0.5 \n\n", 0.5, None),
    (b"5e-1", 0.5, None),
    (b".75", 0.75, None),
    (b"+1.", 1.0, None),
    (b"-0", 0.0, None),
    # Float rounding in a graded verifier: within 1e-6 of [0, 1], clamped and noted.
    (b"1.0000000001", 1.0, "reward 1.0000000001 clamped to 1"),
    (b"-1e-9", 0.0, "reward -1e-09 clamped to 0"),
    (b"1.000001", 1.0, "reward 1.000001 clamped to 1"),
    (b"-0.000001", 0.0, "reward -1e-06 clamped to 0"),
]


@pytest.mark.parametrize("raw, value, note", TXT_OK)
def test_reward_txt_valid(raw, value, note):
    r = parse_reward({"reward.txt": raw})
    assert r == RewardReading(value, error=None, note=note)
    assert math.copysign(1.0, r.value) == 1.0  # never -0.0


TXT_BAD = [
    (b"1 ... tests FAILED", "one number, got 4 words"),
    (b"1\n0", "one number, got 2 words"),
    (b"", "reward.txt is empty"),
    (b" \n\t", "reward.txt is empty"),
    (b"nan", "not a finite decimal number: 'nan'"),
    (b"NaN", "not a finite decimal number"),
    (b"inf", "not a finite decimal number: 'inf'"),
    (b"-Infinity", "not a finite decimal number"),
    (b"1e400", "reward.txt: 1e400 is not a finite number"),
    (b"-1e400", "reward.txt: -1e400 is not a finite number"),
    (b"banana", "not a finite decimal number: 'banana'"),
    (b"1_0", "not a finite decimal number"),  # float() would read 10
    ("\u0661".encode(), "not a finite decimal number"),  # Arabic-Indic digit one: float() reads 1
    (b"0x1", "not a finite decimal number"),
    (b"true", "not a finite decimal number"),
    (b"1\x00", "not a finite decimal number"),
    (b"\xff\xfe1", "not UTF-8"),
    (b"1" + b" " * MAX_TXT_BYTES, f"at most {MAX_TXT_BYTES}"),
    # Finite but out of contract: never paid, however it got there.
    (b"1.5", "reward.txt: reward 1.5 is outside [0, 1]"),
    (b"-1", "reward.txt: reward -1 is outside [0, 1]"),
    (b"2", "reward.txt: reward 2 is outside [0, 1]"),
    (b"1e308", "reward.txt: reward 1e+308 is outside [0, 1]"),
    (b"-1e308", "reward.txt: reward -1e+308 is outside [0, 1]"),
    (b"1.000002", "reward.txt: reward 1.000002 is outside [0, 1]"),
    (b"-2e-6", "reward.txt: reward -2e-06 is outside [0, 1]"),
]


@pytest.mark.parametrize("raw, reason", TXT_BAD)
def test_reward_txt_errors_score_zero_with_reason(raw, reason):
    r = parse_reward({"reward.txt": raw})
    assert r.value == 0.0 and r.note is None
    assert reason in r.error


JSON_OK = [
    (1, 1.0, None),
    (0.25, 0.25, None),
    ({"reward": 0.25}, 0.25, None),
    ({"reward": 1, "accuracy": 0.5, "tests": 12}, 1.0, None),
    ({"reward": 1.0000000001}, 1.0, "reward 1.0000000001 clamped to 1"),
    ({"reward": -1e-9}, 0.0, "reward -1e-09 clamped to 0"),
    (1.0000000001, 1.0, "reward 1.0000000001 clamped to 1"),
    # Only THE reward is range-checked; extra metrics just have to be numbers.
    ({"reward": 0.5, "tests": 12, "loss": -3.5, "big": 1e308}, 0.5, None),
]


@pytest.mark.parametrize("data, value, note", JSON_OK)
def test_reward_json_valid(data, value, note):
    assert parse_reward({"reward.json": json.dumps(data).encode()}) == RewardReading(value, None, note)


JSON_BAD = [
    (b"true", "the value must be a number, got boolean true"),
    (b"false", "got boolean false"),
    (b'"1"', 'got string "1"'),
    (b"null", "got null"),
    (b"[1]", "got array"),
    (b'{"reward": true}', "key 'reward' must be a number, got boolean true"),
    (b'{"reward": "1"}', "key 'reward' must be a number, got string"),
    (b'{"reward": null}', "key 'reward' must be a number, got null"),
    (b'{"reward": {"value": 1}}', "key 'reward' must be a number, got object"),
    (b'{"reward": [1]}', "got array"),
    (b'{"reward": 1, "passed": true}', "key 'passed' must be a number, got boolean"),
    (b'{"reward": 1, "log": "1 ... tests FAILED"}', "key 'log' must be a number, got string"),
    (b'{"score": 1}', "reward.json has no \"reward\" key (keys: 'score')"),
    (b"{}", 'no "reward" key (keys: none)'),
    (b'{"reward": 0, "reward": 1}', "key 'reward' appears more than once"),
    (b"NaN", "reward.json: NaN is not a finite number"),
    (b'{"reward": Infinity}', "reward.json: Infinity is not a finite number"),
    (b'{"reward": -Infinity}', "-Infinity is not a finite number"),
    (b'{"reward": 1e400}', "reward.json: 1e400 is not a finite number"),
    (b"1" + b"0" * 400, "is not a finite number"),  # an integer literal too large for a float
    (b"", "reward.json is empty"),
    (b"{reward: 1}", "not valid JSON"),
    (b"1 0", "not valid JSON"),
    (b"[" * 100_000, "reward.json is 100000 bytes (at most 65536)"),
    (b"\xff", "not UTF-8"),
    (b'{"reward": 2}', 'reward.json key "reward": reward 2 is outside [0, 1]'),
    (b'{"reward": -0.5}', 'reward.json key "reward": reward -0.5 is outside [0, 1]'),
    (b'{"reward": 1e308, "accuracy": 1}', 'reward.json key "reward": reward 1e+308 is outside [0, 1]'),
    (b'{"reward": -1e308}', "reward -1e+308 is outside [0, 1]"),
    (b"1.5", "reward.json: reward 1.5 is outside [0, 1]"),
    (b"7", "reward.json: reward 7 is outside [0, 1]"),
]


@pytest.mark.parametrize("raw, reason", JSON_BAD)
def test_reward_json_errors_score_zero_with_reason(raw, reason):
    r = parse_reward({"reward.json": raw})
    assert r.value == 0.0 and r.note is None
    assert reason in r.error


def test_deeply_nested_json_within_size_limit_is_an_error_not_a_crash():
    raw = b"[" * 30_000 + b"]" * 30_000
    assert len(raw) < 64 << 10  # under the size cap: the parser itself must refuse the depth
    r = parse_reward({"reward.json": raw})
    assert r.value == 0.0 and "reward.json is not valid JSON" in r.error


def test_no_reward_file_and_other_files():
    assert parse_reward({}) == RewardReading(None)
    assert parse_reward({"test-stdout.txt": b"1", "ctrf.json": b"{}"}) == RewardReading(None)


def test_reward_txt_wins_over_reward_json():
    r = parse_reward({"reward.json": b'{"reward": 1}', "reward.txt": b"0.5"})
    assert r == RewardReading(0.5, note="reward.json ignored: reward.txt takes precedence")
    # A bad reward.txt is not rescued by a good reward.json: the rule has one winner.
    r = parse_reward({"reward.txt": b"1 ... tests FAILED", "reward.json": b"1"})
    assert r.value == 0.0 and "4 words" in r.error and "reward.json ignored" in r.note
    r = parse_reward({"reward.txt": b"7", "reward.json": b"1"})
    assert r.value == 0.0 and r.error.startswith("reward.txt: reward 7 is outside [0, 1]")
    assert r.note == "reward.json ignored: reward.txt takes precedence"
    r = parse_reward({"reward.txt": b"1.0000000001", "reward.json": b"1"})
    assert r == RewardReading(
        1.0, note="reward.json ignored: reward.txt takes precedence; reward 1.0000000001 clamped to 1"
    )


def test_non_bytes_content_is_a_caller_bug():
    with pytest.raises(TypeError, match="must be bytes"):
        parse_reward({"reward.txt": "1"})


def test_range_rule_matches_numpy_on_many_values():
    tol = 1e-6  # the contract's number, written out
    assert REWARD_TOLERANCE == tol
    rng = np.random.default_rng(0)
    top = np.float64(1.0) + np.floor(tol * 2.0**52) * 2.0**-52  # the last double within tol above 1
    # Each boundary from both sides: clamped, then just beyond it.
    edges = np.array([top, np.nextafter(top, 2.0), -tol, np.nextafter(-tol, -1.0)])
    values = np.concatenate(
        [
            rng.uniform(-2, 3, 200),
            1.0 + rng.uniform(-3e-6, 3e-6, 50),
            rng.uniform(-3e-6, 3e-6, 50),
            10.0 ** rng.uniform(-300, 308, 50),
            -(10.0 ** rng.uniform(-300, 308, 50)),
            [0.0, 1.0, np.nextafter(1.0, 2.0), np.nextafter(0.0, -1.0), 1 + 1e-6, 1 + 2e-6],
            edges,
            [-2e-6],
            [np.finfo(np.float64).max, -np.finfo(np.float64).max],
        ]
    )
    inside = (values >= 0.0) & (values <= 1.0)
    distance = np.maximum(values - 1.0, 0.0 - values)  # to [0, 1], for values outside it
    rounding = ~inside & (distance <= tol)
    want = np.where(inside, values, np.where(rounding, np.clip(values, 0.0, 1.0), 0.0))
    assert rounding[np.isin(values, edges[::2])].all()
    assert not rounding[np.isin(values, edges[1::2])].any()
    for v, w, ok, rounded in zip(values, want, inside | rounding, rounding):
        text = repr(float(v))  # shortest round-trip decimal
        txt = parse_reward({"reward.txt": text.encode()})
        js = parse_reward({"reward.json": json.dumps({"reward": float(v)}).encode()})
        assert txt.value == js.value == w, (text, txt, js)
        if ok:
            assert txt.error is None and js.error is None, (text, txt, js)
            assert (txt.note is not None) == (js.note is not None) == rounded, (text, txt, js)
        else:
            assert f"reward.txt: reward {text.removesuffix('.0')} is outside [0, 1]" in txt.error
            assert 'reward.json key "reward": reward' in js.error and "is outside [0, 1]" in js.error
            assert txt.note is None and js.note is None


def test_every_reading_is_finite_in_unit_interval_or_none():
    cases = [c[0] for c in TXT_OK + TXT_BAD]
    readings = [parse_reward({"reward.txt": raw}) for raw in cases]
    readings += [parse_reward({"reward.json": raw}) for raw, _ in JSON_BAD]
    readings += [parse_reward({"reward.json": json.dumps(d).encode()}) for d, _, _ in JSON_OK]
    for r in readings:
        assert r.value is not None and math.isfinite(r.value) and 0.0 <= r.value <= 1.0
        assert (r.error is None) or r.value == 0.0


# ---- advantages: the last line of defence -----------------------------------------------------


def test_parsed_huge_rewards_score_zero_and_give_advantages_equal_to_numpy():
    raws = [b"1e308", b"1", b"0", b"1 ... tests FAILED", b"0.5", b"-1e308"]
    rewards = [parse_reward({"reward.txt": raw}).value for raw in raws]
    assert rewards == [0.0, 1.0, 0.0, 0.0, 0.5, 0.0]  # out of [0, 1] is an error: 0, never 1
    gids = [0, 0, 0, 1, 1, 1]
    out = group_advantages(rewards, gids)
    r = np.array(rewards, dtype=np.float64)
    want = np.concatenate([r[:3] - r[:3].mean(), r[3:] - r[3:].mean()])
    assert np.all(np.isfinite(out.advantages))
    np.testing.assert_allclose(out.advantages, want, rtol=1e-6)


def test_unclamped_huge_reward_overflows_and_is_refused_by_name():
    # 1e308 is finite, but the group's mean overflows (sum 2e308 = inf) and the advantages become
    # -inf / NaN: exactly what the issue saw. The raw value must never get here; if it does, stop.
    with pytest.raises(
        NonFiniteAdvantageError, match=r"non-finite advantage for trajectory 0 \(task 'hard'\)"
    ):
        group_advantages([1e308, 1e308, 0.0], ["g", "g", "g"], names=["hard", "hard", "hard"])
    # Finite in float64 but not in the float32 the loss uses.
    with pytest.raises(
        NonFiniteAdvantageError,
        match=r"trajectory 0 \(task 'a'\) of group 7: -inf; trajectory 1 \(task 'b'\) of group 7: inf;",
    ):
        group_advantages([0.0, 1e300, 0.0, 1.0], [7, 7, 8, 8], names=["a", "b", "c", "d"])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_refused_naming_the_task(bad):
    with pytest.raises(NonFiniteAdvantageError) as e:
        group_advantages([0.0, 1.0, bad, 0.0], [0, 0, 1, 1], names=["t0", "t0", "sum-csv", "sum-csv"])
    msg = str(e.value)
    assert "non-finite reward for trajectory 2 (task 'sum-csv') of group 1" in msg
    assert isinstance(e.value, ConfigError)  # callers that catch ConfigError still do


def test_non_finite_message_without_names_and_name_count_checked():
    with pytest.raises(NonFiniteAdvantageError, match=r"trajectory 1 of group 'x': nan"):
        group_advantages([0.0, math.nan], ["x", "x"])
    with pytest.raises(ConfigError, match="names has 1 entries"):
        group_advantages([0.0, 1.0], [0, 0], names=["only-one"])


def test_trainer_step_refuses_a_non_finite_reward_naming_the_task():
    # The learner's own advantage step (Learner.train_on), on real trajectories and config; only the
    # Learner object is stood in for, since building one builds a whole run (model, engine, tasks).
    from types import SimpleNamespace

    from tmax_jax.agent.trajectory import Trajectory
    from tmax_jax.train.config import TrainConfig
    from tmax_jax.train.learner import Learner
    from tmax_jax.train.queue import Group, RolloutBatch

    cfg = dataclasses.replace(TrainConfig(), save_trajectories=False)
    trainer = SimpleNamespace(cfg=cfg, pid=0, nproc=1)
    trajs = [Trajectory("csv-sum", 3, reward=r) for r in (0.0, math.inf)]
    batch = RolloutBatch(index=0, groups=[Group("csv-sum", trajs)])
    with pytest.raises(NonFiniteAdvantageError, match=r"trajectory 1 \(task 'csv-sum'\) of group 3: inf"):
        Learner.train_on(trainer, batch, 0)
    for t in trajs:
        t.reward = 1.0  # a flat group: no update, and no error
    metrics = Learner.train_on(trainer, batch, 0)
    assert metrics["skipped_update"] == 1 and metrics["adv/groups_dropped"] == 1.0
