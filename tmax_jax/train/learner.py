"""The Learner: the train state, the DPPO step on a batch of groups, the weight push, checkpoints.

One learner per JAX process; with several, each feeds its own rows as its part of one global batch,
advantages and metrics come from what all processes gathered, and after every step the new params
(sharded over all hosts) are gathered into a full copy on this process's devices for its engine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from tmax_jax.agent.trajectory import write_jsonl
from tmax_jax.distributed import allgather_json
from tmax_jax.launch import stats as launch_stats
from tmax_jax.rl.packing import pad_rows_across_processes
from tmax_jax.train.config import TrainConfig
from tmax_jax.train.queue import RolloutBatch


class Learner:
    """``state`` is the train state after ``start_step`` steps (restored or fresh); ``replicas``
    (several processes) gathers this process's full copy of the params for its engine."""

    def __init__(
        self,
        cfg: TrainConfig,
        train_step: Any,
        ckpt: Any,
        state: Any,
        *,
        start_step: int,
        run_dir: Path,
        replicas: Any = None,
        pid: int = 0,
        nproc: int = 1,
    ):
        self.cfg, self.train_step, self.ckpt, self.state = cfg, train_step, ckpt, state
        self.start_step, self.run_dir, self.replicas = start_step, Path(run_dir), replicas
        self.pid, self.nproc = pid, nproc
        self.engine = None
        self.draft_fitter = None  # engine.draft_fit_steps: its state is checkpointed with the step's

    # ------------------------------------------------------------------ the engine's weights
    def engine_params(self, *, as_state: bool = True):
        """A copy of the current params for the engine (the train step donates its own); with
        several processes, this process's full copy (a collective: every process calls it)."""
        # Both launch through the process's one launch queue themselves (no lock here).
        params = self.state.params
        params = self.train_step.copy_params(params) if self.replicas is None else self.replicas(params)
        if not as_state:
            return params
        return nnx.state(nnx.merge(self.train_step.graphdef, params, self.train_step.rest))

    def engine_model(self):
        """The policy as a model on the engine's copy of the params (to build the engine from)."""
        return nnx.merge(self.train_step.graphdef, self.engine_params(as_state=False), self.train_step.rest)

    def connect(self, engine: Any) -> None:
        """Push to ``engine`` from now on; it samples as policy version ``start_step`` (a resumed run's
        first tokens carry the restored version)."""
        self.engine = engine
        engine.update_params(engine.params, version=self.start_step)

    def push(self, version: int) -> None:
        """Give the engine the current weights as policy ``version`` (returns once it holds them)."""
        if self.replicas is None:
            # The engine copies them itself, in one program (its split into periods is the copy):
            # no full copy of ours alive beside it. Waited for: the next step donates these buffers.
            state = nnx.state(self.train_step.model(self.state))
            self.engine.update_params(state, version=version, copy=True)
            jax.block_until_ready(self.engine.params)
        else:  # each process's full copy (a collective), already buffers of its own
            self.engine.update_params(jax.block_until_ready(self.engine_params()), version=version)

    # ------------------------------------------------------------------ one step
    def step(self, batch: RolloutBatch, step: int) -> dict:
        """Train on ``batch`` as step ``step`` and push the weights of step ``step + 1`` to the engine."""
        t0 = time.monotonic()
        metrics = self.train_on(batch, step)
        t_sync = time.monotonic()
        self.push(step + 1)
        metrics.update(
            train_s=time.monotonic() - t0,
            weight_sync_s=time.monotonic()
            - t_sync,  # the engine's copy (all hosts: a reshard over the slice)
            # waiting for the launch lock (tmax_jax.launch; 0 where it is off, e.g. CPU)
            launch_wait_s=launch_stats(reset=True)["launch_wait_s"],
        )
        return metrics

    def trajectory_file(self, step: int) -> Path:
        """Where the episodes trained on at ``step`` are written (one file per process when several)."""
        part = f".p{self.pid}" if self.nproc > 1 else ""
        return self.run_dir / "trajectories" / f"step_{step:06d}{part}.jsonl"

    def train_on(self, batch: RolloutBatch, step: int) -> dict:
        """Advantages over every process's episodes, this process's rows packed, one train step."""
        from tmax_jax.rl.advantages import group_advantages
        from tmax_jax.rl.packing import ROUTING_FIELD, pack_trajectories, routing_field
        from tmax_jax.rl.train_step import LAG_FIELD, policy_lag

        cfg = self.cfg
        trajs = [t for g in batch.groups for t in g.trajectories]
        if cfg.save_trajectories and trajs:
            write_jsonl(self.trajectory_file(step + 1), trajs)
        # What metrics and advantages need of every episode of the step, from every process (in
        # process order: this process's episodes start at `offset`); groups never span processes.
        shares = allgather_json(
            [
                [
                    t.reward,
                    bool(t.info.get("passed", False)),
                    t.group_id,
                    t.num_turns,
                    len(t.tokens),
                    t.num_format_errors,
                    step - t.min_version if t.num_generated else 0,
                    t.task_id,
                ]
                for t in trajs
            ]
            + [batch.dropped_stale]
        )
        dropped = sum(share.pop() for share in shares)
        offset = sum(len(share) for share in shares[: self.pid])
        everyone = [e for share in shares for e in share]
        rewards, passed, gids, turns, tokens, format_errors, staleness, task_ids = (
            [list(c) for c in zip(*everyone)] if everyone else [[]] * 8
        )

        def mean(xs) -> float:
            return float(np.mean(xs)) if xs else 0.0

        metrics: dict = {
            "reward_mean": mean(rewards),
            "pass_rate": mean(passed),
            "groups_stale_dropped": dropped,
            "episode_turns_mean": mean(turns),
            "episode_tokens_mean": mean(tokens),
            "format_errors_mean": mean(format_errors),
            "staleness_max": max(staleness, default=0),
        }
        if not everyone:
            metrics["skipped_update"] = 1
            return metrics
        adv = group_advantages(rewards, gids, cfg.rl.advantage, names=task_ids)
        metrics.update({f"adv/{k}": v for k, v in adv.stats().items()})
        kept = [i for i, k in enumerate(adv.keep) if k]
        if not kept:
            metrics["skipped_update"] = 1  # every group was flat: no learning signal this step
            return metrics
        mine = [i for i in kept if offset <= i < offset + len(trajs)]
        # A process whose groups were all flat still feeds rows (empty ones) to the global batch.
        mine_trajs = [trajs[i - offset] for i in mine]
        packed, placement = pack_trajectories(
            mine_trajs, [float(adv.advantages[i]) for i in mine], seq_len=cfg.seq_len
        )
        # Per target, how many versions behind the learner it was sampled (mismatch vs staleness metrics).
        packed[LAG_FIELD] = policy_lag(mine_trajs, placement, packed["input_ids"].shape, step)
        if self.train_step.routing_replay:  # the rollout engine's experts for the inputs it fed
            packed[ROUTING_FIELD] = routing_field(
                mine_trajs, placement, packed["input_ids"].shape, self.train_step.routing_shape
            )
        packed = pad_rows_across_processes(packed, self.train_step.rows_multiple)
        t0 = time.monotonic()
        self.state, m = self.train_step(self.state, packed)
        m = {k: float(v) for k, v in m.items()}
        dt = time.monotonic() - t0
        metrics.update(m)
        metrics["skipped_update"] = 0
        metrics["train_tokens_per_s"] = float(sum(tokens[i] - 1 for i in kept)) / max(dt, 1e-9)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int, loader_state: dict | None, *, force: bool = False) -> None:
        """Checkpoint ``step`` when the interval (or ``force``) says so, with every process's loader position."""
        if not force and step % self.cfg.save_every:
            return
        loaders = allgather_json(loader_state)  # same decision on every process: all enter it
        draft = None if self.draft_fitter is None else self.draft_fitter.state()
        self.ckpt.save(step, self.state, {"loaders": loaders, "version": step}, force=True, draft=draft)

    def saved(self, step: int) -> bool:
        return step in self.ckpt.steps()

    def close(self) -> None:
        self.ckpt.close()
