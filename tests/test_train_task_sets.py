"""Task sets of a train config (train/setup.py): generator and demo families with weights, axis
filters, task dirs, held-out tasks disjoint from training ones, the split written to the run dir."""

import json
from collections import Counter

import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.tasks import load_task
from tmax_jax.tasks.generator.registry import all_families
from tmax_jax.tasks.model import task_axes, task_family
from tmax_jax.train.config import load_train_config
from tmax_jax.train.demo_tasks import HELDOUT_NAMES, TRAIN_NAMES, write_tasks
from tmax_jax.train.setup import load_task_sets


def _cfg(tmp_path, **tasks):
    return load_train_config(None, {"run_dir": str(tmp_path / "run"), "tasks": tasks})


def _instructions(root, split):
    return [p.read_text().strip() for p in sorted((root / split).glob("*/instruction.md"))]


def test_weighted_generator_and_demo_families(tmp_path):
    cfg = _cfg(
        tmp_path,
        families={"largest_number": 2, "log_error_count": 1, "cidr_membership": 1},
        num_train=12,
        num_heldout=8,
    )
    train, held = load_task_sets(cfg, tmp_path / "run")
    fams = Counter(task_family(t) for t in train)
    assert fams == {"largest_number": 6, "log_error_count": 3, "cidr_membership": 3}
    assert Counter(task_family(t) for t in held) == {
        "largest_number": 4,
        "log_error_count": 2,
        "cidr_membership": 2,
    }
    root = tmp_path / "run" / "tasks"
    tr, he = _instructions(root, "train"), _instructions(root, "heldout")
    assert len(tr) == 12 and len(he) == 8 and not set(tr) & set(he)
    split = json.loads((root / "split.json").read_text())
    assert sorted(split["train"]) == sorted(t.path.name for t in train)
    # Generator tasks carry their axes; the demo's held-out names are never training names.
    cidr = next(t for t in train if task_family(t) == "cidr_membership")
    assert task_axes(cidr)["domain"] == all_families()["cidr_membership"].domain
    for t in held:
        if task_family(t) == "largest_number":
            assert any(f"/{n}.txt" in t.instruction for n in HELDOUT_NAMES)
            assert not any(f"/{n}.txt" in t.instruction for n in TRAIN_NAMES)
    # A second call (a resumed run) reads the same tasks back.
    train2, held2 = load_task_sets(cfg, tmp_path / "run")
    assert [t.path for t in train2] == [t.path for t in train] and len(held2) == len(held)


def test_axis_filter_and_heldout_families(tmp_path):
    cfg = _cfg(
        tmp_path,
        axes={"verifier_kind": ["metric_threshold"]},
        heldout_families=["largest_number"],
        num_train=10,
        num_heldout=3,
    )
    train, held = load_task_sets(cfg, tmp_path / "run")
    want = {n for n, f in all_families().items() if f.verifier_kind == "metric_threshold"}
    assert want and {task_family(t) for t in train} <= want and len(train) == 10
    assert {task_family(t) for t in held} == {"largest_number"} and len(held) == 3


def test_dirs_alone_or_mixed(tmp_path):
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    write_tasks(d1, range(8))
    write_tasks(d2, range(100, 104))
    cfg = _cfg(tmp_path, dir=[str(d1), str(d2)], families=["largest_number"], num_train=4, num_heldout=2)
    train, held = load_task_sets(cfg, tmp_path / "run")
    # Without mix the dirs replace the families: 8 // 4 = 2 held out of d1, 4 // 4 = 1 of d2, less
    # those asking what a training task asks (16 words, so some do).
    dropped = json.loads((tmp_path / "run" / "tasks" / "split.json").read_text())["dropped_heldout"]
    assert len(train) == 9 and len(held) + len(dropped) == 3
    assert not {t.instruction for t in held} & {t.instruction for t in train}
    assert {task_family(t) for t in train + held} == {"write_word"}
    cfg = _cfg(tmp_path / "m", dir=str(d1), families=["largest_number"], num_train=4, num_heldout=2, mix=True)
    train, held = load_task_sets(cfg, tmp_path / "m" / "run")
    assert Counter(task_family(t) for t in train) == {"write_word": 6, "largest_number": 4}
    assert Counter(task_family(t) for t in held)["largest_number"] == 2
    assert not {t.instruction for t in held} & {t.instruction for t in train}
    for t in train + held:
        assert load_task(t.path).instruction == t.instruction


def test_heldout_copies_of_training_instructions_are_dropped(tmp_path):
    # write_word with one word: every task asks the same thing, so no held-out task survives.
    cfg = _cfg(tmp_path, families=["write_word"], words=1, num_train=4, num_heldout=4)
    with pytest.raises(ConfigError, match="0 held-out"):
        load_task_sets(cfg, tmp_path / "run")


def test_bad_task_configs_are_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown \\['no_such_family'\\]"):
        load_task_sets(_cfg(tmp_path, families=["no_such_family"]), tmp_path / "run")
    with pytest.raises(ConfigError, match="weights must be numbers > 0"):
        _cfg(tmp_path, families={"largest_number": 0})
    with pytest.raises(ConfigError, match="unknown axis"):
        _cfg(tmp_path, axes={"colour": ["red"]})
    with pytest.raises(ConfigError, match="matches no task family"):
        load_task_sets(_cfg(tmp_path / "a", axes={"domain": ["no_such_domain"]}), tmp_path / "a" / "run")
    with pytest.raises(ConfigError, match="also training families"):
        load_task_sets(
            _cfg(tmp_path / "b", families=["largest_number"], heldout_families=["largest_number"]),
            tmp_path / "b" / "run",
        )
