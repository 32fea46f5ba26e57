import threading
import time

import pytest

from tmax_jax.agent.trajectory import Trajectory, read_jsonl, write_jsonl
from tmax_jax.train.metrics import MetricsWriter
from tmax_jax.train.queue import Group, QueueClosed, RolloutBatch, RolloutQueue


def _group(task: str, versions: list[int], reward: float = 0.0) -> Group:
    trajs = []
    for i, v in enumerate(versions):
        t = Trajectory(task_id=task, group_id=i)
        t.append([1, 2], generated=False)
        t.append([3, 4], generated=True, logprobs=[-0.1, -0.2], versions=[v, v + 1])
        t.reward = reward
        trajs.append(t)
    return Group(task, trajs)


def test_stale_groups_are_dropped_and_counted():
    q = RolloutQueue(capacity=8, max_staleness=2)
    q.put(RolloutBatch(0, [_group("old", [0, 5]), _group("fresh", [3, 4])]))  # "old": a token from v0
    q.put(RolloutBatch(1, [_group("fresh2", [5])]))
    b0 = q.get(current_version=5)
    assert b0.index == 0 and [g.task_id for g in b0.groups] == ["fresh"] and b0.dropped_stale == 1
    b1 = q.get(current_version=5)
    assert [g.task_id for g in b1.groups] == ["fresh2"] and b1.dropped_stale == 0
    assert q.dropped_stale == 1 and len(q) == 0


def test_back_pressure_blocks_producer_until_consumed():
    q = RolloutQueue(capacity=1, max_staleness=10)
    q.put(RolloutBatch(0, [_group("a", [0])]))
    done = threading.Event()

    def producer():
        q.put(RolloutBatch(1, [_group("b", [0])]))
        done.set()

    th = threading.Thread(target=producer)
    th.start()
    time.sleep(0.2)
    assert not done.is_set()  # blocked: the queue is full
    assert q.get(current_version=0).index == 0
    th.join(timeout=5)
    assert done.is_set() and len(q) == 1


def test_timeout_and_close_wake_waiters():
    q = RolloutQueue(capacity=4, max_staleness=10)
    with pytest.raises(TimeoutError):
        q.get(current_version=0, timeout=0.1)
    q.close()
    with pytest.raises(QueueClosed):
        q.get(current_version=0)
    with pytest.raises(QueueClosed):
        q.put(RolloutBatch(0, []))


def test_trajectory_jsonl_round_trip_and_validation(tmp_path):
    g = _group("t", [1, 2], reward=1.0)
    write_jsonl(tmp_path / "traj.jsonl", g.trajectories)
    back = list(read_jsonl(tmp_path / "traj.jsonl"))
    assert [b.to_json() for b in back] == [t.to_json() for t in g.trajectories]
    assert back[0].response_mask == [0, 0, 1, 1] and back[0].policy_versions == [-1, -1, 1, 2]
    assert g.min_version == 1 and g.rewards == [1.0, 1.0]
    bad = g.trajectories[0].to_json()
    bad["response_mask"] = [1]
    with pytest.raises(Exception, match="response_mask has 1 entries"):
        Trajectory.from_json(bad)


def test_metrics_jsonl_and_truncate_on_resume(tmp_path):
    m = MetricsWriter(tmp_path)  # TensorBoard on: the default
    for step in range(1, 5):
        m.write(step, {"loss": 1.0 / step, "nan": float("nan"), "name": "x"})
    m.truncate_after(2)
    rows = m.read()
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] == 0.5 and rows[0]["nan"] is None
    m.close()
    assert any((tmp_path / "tb").iterdir())
