"""grain prompt loading: seeded shuffling, disjoint covering shards, epochs, exact resume."""

import json
from pathlib import Path

import pytest

from tmax_jax.data import DataConfig, PromptLoader, discover_tasks, prompt_dataset, read_instruction
from tmax_jax.errors import ConfigError, TaskFormatError


def _records(n):
    return [{"task_id": f"t{i:03d}", "instruction": f"do thing {i}"} for i in range(n)]


def _ids(ds, count):
    return [ds[i]["task_id"] for i in range(count)]


def test_shuffle_is_seeded():
    recs = _records(40)
    a = _ids(prompt_dataset(recs, DataConfig(seed=1), shard_index=0, shard_count=1), 40)
    b = _ids(prompt_dataset(recs, DataConfig(seed=1), shard_index=0, shard_count=1), 40)
    c = _ids(prompt_dataset(recs, DataConfig(seed=2), shard_index=0, shard_count=1), 40)
    assert a == b
    assert a != c
    assert sorted(a) == [r["task_id"] for r in recs]  # a permutation, nothing lost
    assert a != [r["task_id"] for r in recs]
    plain = _ids(prompt_dataset(recs, DataConfig(shuffle=False), shard_index=0, shard_count=1), 40)
    assert plain == [r["task_id"] for r in recs]


def test_epochs_reshuffle_and_cover_each_epoch():
    recs = _records(12)
    ds = prompt_dataset(recs, DataConfig(seed=3, num_epochs=3), shard_index=0, shard_count=1)
    assert len(ds) == 36
    epochs = [_ids(ds, 36)[e * 12 : (e + 1) * 12] for e in range(3)]
    for ep in epochs:
        assert sorted(ep) == [r["task_id"] for r in recs]
    assert epochs[0] != epochs[1]


@pytest.mark.parametrize("n,count,drop", [(40, 4, True), (43, 4, False), (43, 4, True), (9, 3, True)])
def test_shards_are_disjoint_and_cover(n, count, drop):
    recs = _records(n)
    cfg = DataConfig(seed=5, num_epochs=1, drop_remainder=drop)
    shards = [
        set(_ids(ds, len(ds)))
        for ds in (prompt_dataset(recs, cfg, shard_index=i, shard_count=count) for i in range(count))
    ]
    for i in range(count):
        for j in range(i + 1, count):
            assert not shards[i] & shards[j]
    union = set().union(*shards)
    expected = {r["task_id"] for r in recs[: n - n % count]} if drop else {r["task_id"] for r in recs}
    assert union == expected
    if drop:
        assert len({len(s) for s in shards}) == 1  # every host runs the same number of steps


def test_default_shard_is_this_jax_process():
    import jax

    ds = prompt_dataset(_records(8), DataConfig(num_epochs=1))
    assert len(ds) == 8 // jax.process_count()


def test_state_restore_continues_identically(tmp_path):
    recs = _records(23)
    cfg = DataConfig(seed=7)  # infinite repeat, as in RL training
    ref = PromptLoader(recs, batch_size=5, cfg=cfg, shard_index=1, shard_count=2)
    for _ in range(3):
        ref.next_batch()
    ref.save(tmp_path / "data_state.json")
    expected = [[r["task_id"] for r in ref.next_batch()] for _ in range(6)]  # crosses an epoch boundary

    resumed = PromptLoader(recs, batch_size=5, cfg=cfg, shard_index=1, shard_count=2)
    resumed.load(tmp_path / "data_state.json")
    assert resumed.batches_done == 3
    got = [[r["task_id"] for r in resumed.next_batch()] for _ in range(6)]
    assert got == expected

    fresh = PromptLoader(recs, batch_size=5, cfg=cfg, shard_index=1, shard_count=2)
    assert [r["task_id"] for r in fresh.next_batch()] != expected[0]


def test_state_from_another_config_is_refused():
    recs = _records(10)
    a = PromptLoader(recs, batch_size=2, cfg=DataConfig(seed=1), shard_index=0, shard_count=1)
    b = PromptLoader(recs, batch_size=2, cfg=DataConfig(seed=2), shard_index=0, shard_count=1)
    with pytest.raises(ConfigError, match="different prompts"):
        b.set_state(a.get_state())


def test_finite_epochs_end_with_a_short_batch():
    loader = PromptLoader(
        _records(7), batch_size=3, cfg=DataConfig(num_epochs=1), shard_index=0, shard_count=1
    )
    sizes = [len(b) for b in loader]
    assert sizes == [3, 3, 1]


def test_discover_reads_harbor_and_tmax_tasks(tmp_path):
    harbor = tmp_path / "b-harbor"
    for sub in ("tests", "environment"):
        (harbor / sub).mkdir(parents=True)
    (harbor / "instruction.md").write_text("Make hello.txt\n")
    (harbor / "task.toml").write_text('version = "1.0"\n')
    (harbor / "tests" / "test.sh").write_text("exit 0\n")
    (harbor / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\n")
    (tmp_path / "a-tmax" / "fixtures" / "nested").mkdir(parents=True)
    (tmp_path / "a-tmax" / "task.json").write_text(json.dumps({"prompt": "Count the lines"}))
    (tmp_path / "a-tmax" / "test_final_state.py").write_text("def test_ok():\n    pass\n")
    # A fixture that happens to hold a task.json is not a task of its own.
    (tmp_path / "a-tmax" / "fixtures" / "nested" / "task.json").write_text("{}")
    recs = discover_tasks(tmp_path)
    assert [r["task_id"] for r in recs] == ["a-tmax", "b-harbor"]
    ds = prompt_dataset(recs, DataConfig(shuffle=False, num_epochs=1), shard_index=0, shard_count=1)
    assert [ds[0]["instruction"], ds[1]["instruction"]] == ["Count the lines", "Make hello.txt"]
    # The repository's own example tasks load the same way.
    repo_tasks = Path(__file__).parent / "tasks"
    assert {r["task_id"] for r in discover_tasks(repo_tasks)} >= {"harbor_csv_sum", "tmax_log_errors"}


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(TaskFormatError, match="not found"):
        discover_tasks(tmp_path / "missing")
    with pytest.raises(TaskFormatError, match="no task directories"):
        discover_tasks(tmp_path)
    (tmp_path / "task.json").write_text("{broken")
    with pytest.raises(TaskFormatError, match="task.json"):
        read_instruction(tmp_path)
    with pytest.raises(ConfigError, match="shard_index"):
        prompt_dataset(_records(4), shard_index=4, shard_count=4)
    with pytest.raises(ConfigError, match="cannot fill"):
        prompt_dataset(_records(3), shard_index=0, shard_count=4)
    with pytest.raises(ConfigError, match="num_epochs"):
        DataConfig(num_epochs=0)
