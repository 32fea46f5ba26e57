"""A rollout queue with a staleness bound.

Rollout workers put whole groups (all trajectories of one prompt); the trainer takes groups for the
next step. A group is *stale* when its oldest token was sampled by a policy more than
``max_staleness`` versions behind the trainer's current version; stale groups are dropped and counted
(TMAX runs with 4 async steps and in-flight weight updates, so a group may mix versions).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

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


class QueueClosed(Exception):
    pass


class RolloutQueue:
    def __init__(self, capacity: int, max_staleness: int):
        if capacity <= 0:
            raise ValueError("queue capacity must be positive")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self._items: collections.deque[Group] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self.dropped_stale = 0
        self.wait_put_s = 0.0
        self.wait_get_s = 0.0

    def put(self, group: Group, timeout: float | None = None) -> None:
        """Blocks while full (back-pressure on the rollout side)."""
        t0 = time.monotonic()
        with self._cv:
            while len(self._items) >= self.capacity and not self._closed:
                if not self._cv.wait(timeout):
                    raise TimeoutError("rollout queue full")
            if self._closed:
                raise QueueClosed
            self._items.append(group)
            self.wait_put_s += time.monotonic() - t0
            self._cv.notify_all()

    def get(self, n: int, current_version: int, timeout: float | None = None) -> list[Group]:
        """Take ``n`` fresh groups, dropping stale ones on the way (blocks until enough arrive)."""
        t0 = time.monotonic()
        out: list[Group] = []
        deadline = None if timeout is None else t0 + timeout
        with self._cv:
            while len(out) < n:
                while self._items and len(out) < n:
                    g = self._items.popleft()
                    if current_version - g.min_version > self.max_staleness:
                        self.dropped_stale += 1
                    else:
                        out.append(g)
                    self._cv.notify_all()
                if len(out) >= n:
                    break
                if self._closed:
                    raise QueueClosed
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    # Give back what we took so nothing is lost on a timeout.
                    self._items.extendleft(reversed(out))
                    raise TimeoutError(f"got {len(out)} of {n} groups before the timeout")
                self._cv.wait(remaining)
        self.wait_get_s += time.monotonic() - t0
        return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)
