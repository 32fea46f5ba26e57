"""A rollout queue with a staleness bound.

Rollout workers put one ``RolloutBatch`` per trainer step (the groups of ``prompts_per_step``
prompts, each group all samples of one prompt), in step order. The trainer takes the next batch.
A group is *stale* when its oldest token was sampled by a policy more than ``max_staleness``
versions behind the trainer's current version; stale groups are dropped and counted (TMAX runs
with 4 async steps and in-flight weight updates, so one group may mix versions). The queue's
capacity bounds how far rollouts run ahead of training (back-pressure).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

from tmax_jax.agent.trajectory import Trajectory


@dataclasses.dataclass
class Group:
    task_id: str
    trajectories: list[Trajectory]

    @property
    def min_version(self) -> int:
        versions = [t.min_version for t in self.trajectories if t.num_generated]
        return min(versions) if versions else -1

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


@dataclasses.dataclass
class RolloutBatch:
    index: int  # the trainer step (0-based prompt batch) these groups belong to
    groups: list[Group]
    data_state: Any = None  # prompt-loader state *after* this batch was drawn (for resume)
    rollout_s: float = 0.0
    dropped_stale: int = 0


class QueueClosed(Exception):
    pass


class RolloutQueue:
    def __init__(self, capacity: int, max_staleness: int):
        if capacity <= 0:
            raise ValueError("queue capacity must be positive")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self._items: collections.deque[RolloutBatch] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self.dropped_stale = 0
        self.wait_put_s = 0.0
        self.wait_get_s = 0.0

    def put(self, batch: RolloutBatch, timeout: float | None = None) -> None:
        """Blocks while full (back-pressure on the rollout side)."""
        t0 = time.monotonic()
        with self._cv:
            while len(self._items) >= self.capacity and not self._closed:
                if not self._cv.wait(timeout):
                    raise TimeoutError("rollout queue full")
            if self._closed:
                raise QueueClosed
            self._items.append(batch)
            self.wait_put_s += time.monotonic() - t0
            self._cv.notify_all()

    def get(self, current_version: int, timeout: float | None = None) -> RolloutBatch:
        """The next batch, with groups staler than the bound removed (``batch.dropped_stale`` counts them)."""
        t0 = time.monotonic()
        with self._cv:
            while not self._items:
                if self._closed:
                    raise QueueClosed
                if not self._cv.wait(timeout):
                    raise TimeoutError("no rollout batch before the timeout")
            batch = self._items.popleft()
            self._cv.notify_all()
        fresh = [g for g in batch.groups if current_version - g.min_version <= self.max_staleness]
        batch.dropped_stale = len(batch.groups) - len(fresh)
        batch.groups = fresh
        self.dropped_stale += batch.dropped_stale
        self.wait_get_s += time.monotonic() - t0
        return batch

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)
