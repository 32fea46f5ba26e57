"""The Producer: rollout workers feeding the learner through the bounded-staleness queue.

A thread runs one batch of groups per step (episodes in sandboxes over the engine's orchestrator),
at most ``max_staleness`` steps ahead of the learner; the learner takes them in order with
:meth:`Producer.next_batch` and reports each step it finishes with :meth:`Producer.learner_reached`.
With several JAX processes each process's producer runs its shard of the step's prompts (seeds and
group ids are global). The same workers answer the held-out evaluations between steps.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from tmax_jax.errors import TmaxError
from tmax_jax.train.config import TrainConfig
from tmax_jax.train.queue import QueueClosed, RolloutBatch, RolloutQueue
from tmax_jax.train.rollout import RolloutWorkers


def kill_sandboxes() -> None:
    """Kill every sandbox of this process (an interrupt or an error: nothing may outlive the run)."""
    from tmax_jax.sandbox import registry

    registry.close_all()


class Producer:
    def __init__(
        self,
        cfg: TrainConfig,
        engine: Any,
        tokenizer: Any,
        chat: Any,
        train_tasks: list,
        loader: Any,
        active: Any = None,
        *,
        pid: int = 0,
        nproc: int = 1,
    ):
        self.cfg, self.engine, self.tokenizer, self.chat = cfg, engine, tokenizer, chat
        self.train_tasks, self.loader, self.active = train_tasks, loader, active
        self.pid, self.nproc = pid, nproc
        self.workers: RolloutWorkers | None = None
        self.orch = None
        self.queue: RolloutQueue | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._step_cv = threading.Condition()
        self._learner_step = 0
        self._curriculum_metrics: dict[int, dict] = {}
        self.start_workers()

    # ------------------------------------------------------------------ workers
    def start_workers(self) -> None:
        from tmax_jax.engine.orchestrator import Orchestrator

        cfg = self.cfg
        self.orch = Orchestrator(self.engine, tokenizer=self.tokenizer)
        self.workers = RolloutWorkers(
            self.orch,
            self.chat,
            cfg.agent,
            cfg.sandbox,
            workers=cfg.rollout_workers,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            require_submit=cfg.reward_requires_submit,
        )

    def stop_workers(self, *, now: bool) -> None:
        """Shut the rollout workers and the orchestrator down (idempotent). ``now`` (an interrupt or an
        error) also cancels queued episodes and kills the process's sandboxes, so running episodes end
        at their next command or token instead of playing out."""
        workers, orch = self.workers, self.orch
        if workers is not None:
            workers.stopping.set()
        if now:
            if orch is not None:
                orch.stop()
            kill_sandboxes()
        if workers is not None:
            workers.close()
        if orch is not None:
            orch.stop()

    def pass_rate(self, tasks: list) -> dict:
        return self.workers.pass_rate(tasks, self.cfg.eval.samples_per_task, self.cfg.seed)

    def final_pass_rate(self, tasks: list) -> dict:
        """``pass_rate`` on fresh workers (the loop's were shut down with it)."""
        self.start_workers()
        try:
            return self.pass_rate(tasks)
        except BaseException:
            self.stop_workers(now=True)
            raise
        finally:
            self.stop_workers(now=False)

    # ------------------------------------------------------------------ the queue
    def start(self, first_index: int) -> None:
        """Start producing batches ``first_index, first_index + 1, ...`` (the learner is at ``first_index``)."""
        cfg = self.cfg
        self.queue = RolloutQueue(capacity=max(cfg.max_staleness, 1), max_staleness=cfg.max_staleness)
        self.error = None
        self._learner_step = first_index
        self._thread = threading.Thread(
            target=self._produce, args=(first_index,), name="tmax-rollouts", daemon=True
        )
        self._thread.start()

    def next_batch(self, step: int) -> RolloutBatch:
        """The next batch fresh enough for the learner at ``step`` (staler groups are dropped)."""
        try:
            return self.queue.get(current_version=step)
        except QueueClosed:
            raise TmaxError(f"rollout worker failed: {self.error!r}") from self.error

    def learner_reached(self, step: int) -> None:
        """The learner finished ``step`` steps: batches up to ``step + max_staleness`` may start."""
        with self._step_cv:
            self._learner_step = step
            self._step_cv.notify_all()

    def step_stats(self, index: int) -> dict:
        """Batch ``index``'s curriculum metrics and the rollout counters since the last call."""
        out = {**self._curriculum_metrics.pop(index, {}), **self.workers.stats.snapshot_and_reset()}
        k = getattr(self.engine, "tokens_per_step", 1) - 1
        if k and self.orch is not None:
            # Speculative decoding: tokens per model step and slot (1 to k + 1), and the fraction of
            # drafted tokens kept (they fall as the policy drifts from a frozen draft).
            slot_steps, tokens = self.orch.take_decode_counts()
            if slot_steps:
                out["speculative/tokens_per_step"] = tokens / slot_steps
                out["speculative/acceptance"] = (tokens / slot_steps - 1) / k
        return out

    def close(self) -> None:
        """Stop producing, shut the workers down and join the thread (idempotent)."""
        self._stop.set()
        if self.queue is not None:
            self.queue.close()
        self.stop_workers(now=False)
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _produce(self, index: int) -> None:
        cfg = self.cfg
        try:
            while not self._stop.is_set() and index < cfg.steps:
                with self._step_cv:
                    # Bounded lead: batch `index` may start once the learner reached index - max_staleness.
                    while index - self._learner_step > cfg.max_staleness and not self._stop.is_set():
                        self._step_cv.wait(0.5)
                if self._stop.is_set():
                    break
                t0 = time.monotonic()
                groups, data_state = self._groups(index)
                self.queue.put(RolloutBatch(index, groups, data_state, rollout_s=time.monotonic() - t0))
                index += 1
        except QueueClosed:
            pass
        except BaseException as e:  # surfaced by the learner's next_batch
            self.error = e
            self.queue.close()

    def _groups(self, index: int) -> tuple[list, dict]:
        """Step ``index``'s groups and the data position after them."""
        cfg = self.cfg
        if self.active is not None:
            groups = self._curriculum_groups(index)
            return groups, {"curriculum": self.active.curriculum.state_dict()}
        records = self.loader.next_batch()
        data_state = self.loader.get_state()
        tasks = [self.train_tasks[int(r["task_id"])] for r in records]
        # Prompt p of this process is prompt first + p of the step (seeds and group ids are global).
        first = self.pid * (cfg.prompts_per_step // self.nproc)
        keys = [(cfg.seed, index, first + p) for p in range(len(tasks))]
        gids = [index * cfg.prompts_per_step + first + p for p in range(len(tasks))]
        return self.workers.groups(tasks, cfg.group_size, keys, gids), data_state

    def _curriculum_groups(self, index: int) -> list:
        """Step ``index``'s groups by active sampling; its curriculum metrics are kept for the learner."""
        cfg = self.cfg
        per_process = cfg.prompts_per_step // self.nproc
        first = self.pid * per_process

        def run_groups(prompts: list[int], draw: int) -> list[tuple]:
            tasks = [self.train_tasks[i] for i in prompts]
            # Draw 0 seeds its episodes as the loader path does; later draws get their own seeds and
            # group ids (unique within the step, over all processes).
            keys = [(cfg.seed, index, draw * cfg.prompts_per_step + first + p) for p in range(len(tasks))]
            gids = [
                (index * cfg.curriculum.max_draws + draw) * cfg.prompts_per_step + first + p
                for p in range(len(tasks))
            ]
            groups = self.workers.groups(tasks, cfg.group_size, keys, gids)
            return [
                (
                    g,
                    g.rewards,
                    float(np.mean([bool(t.info.get("passed")) for t in g.trajectories]))
                    if g.trajectories
                    else 0.0,
                )
                for g in groups
            ]

        groups, metrics = self.active.step(index, run_groups)
        self._curriculum_metrics[index] = metrics
        return groups
