"""``tmax-jax train``: warm start, then asynchronous DPPO with rollouts in sandboxes.

One JAX process runs everything: rollout workers (episode threads over the sandbox pool and the
engine's orchestrator) produce one batch of groups per step, up to ``async_steps`` ahead of the
trainer; the trainer drops stale groups, soft-filters flat groups, computes group advantages,
packs the trajectories into rows, runs the jitted DPPO step and pushes the new weights to the
engine (no recompilation; episodes in flight continue with the new weights, and every token
records the version that sampled it). Checkpoints (orbax) carry the train state and the prompt
loader position, so a killed run resumes at the step after its last checkpoint.

Several JAX processes (a TPU pod, GPU hosts: the same command on every host after
``jax.distributed.initialize``) each sample on an engine of their own over their local devices: each
reads its own shard of the prompts, runs its groups, packs its rows and feeds them as its part of one
global batch; after every step the new params, sharded over all hosts, are gathered into a full copy
on each host's devices for its engine. Advantages, metrics and evaluations are computed from what
all processes gathered; process 0 writes the run's files; a stop signal on any process stops all of
them at the same step boundary.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tmax_jax.agent.episode import make_chat
from tmax_jax.agent.trajectory import write_jsonl
from tmax_jax.data import DataConfig, PromptLoader
from tmax_jax.distributed import (
    allgather_json,
    any_process,
    barrier,
    is_primary,
    primary_first,
    synchronous_cpu_dispatch,
)
from tmax_jax.errors import ConfigError, TmaxError
from tmax_jax.launch import serial_launch
from tmax_jax.launch import stats as launch_stats
from tmax_jax.rl.packing import pad_rows_across_processes
from tmax_jax.train.config import TrainConfig
from tmax_jax.train.metrics import MetricsWriter, progress_bar
from tmax_jax.train.plot import line_chart
from tmax_jax.train.queue import QueueClosed, RolloutBatch, RolloutQueue
from tmax_jax.train.rollout import RolloutWorkers, demonstrations, pass_rates_by_group
from tmax_jax.train.setup import (
    enable_compilation_cache,
    load_task_sets,
    policy_checkpoint,
    prepare_run_dir,
)


def _log(msg: str) -> None:
    who = f" p{jax.process_index()}/{jax.process_count()}" if jax.process_count() > 1 else ""
    print(f"[tmax-jax train{who}] {msg}", file=sys.stderr, flush=True)


class Trainer:
    def __init__(self, cfg: TrainConfig, *, progress: bool = True):
        synchronous_cpu_dispatch()
        enable_compilation_cache()
        self.cfg = cfg
        self.pid, self.nproc = jax.process_index(), jax.process_count()
        self.progress = progress and is_primary()
        self.run_dir = Path(cfg.run_dir)
        self._stop = threading.Event()
        self._trainer_step = 0
        self._step_cv = threading.Condition()

    # ------------------------------------------------------------------ set-up
    def _build(self):
        from tmax_jax.checkpoints import load_hf
        from tmax_jax.engine.engine import Engine
        from tmax_jax.rl.state import TrainCheckpointer
        from tmax_jax.rl.train_step import TrainStep
        from tmax_jax.sharding import ProcessReplicas, make_mesh
        from tmax_jax.tokenizer import load_tokenizer

        cfg = self.cfg
        if cfg.prompts_per_step % self.nproc:
            raise ConfigError(
                f"prompts_per_step={cfg.prompts_per_step} must be divisible by the {self.nproc} JAX "
                "processes (each runs the same number of groups per step)"
            )
        # Files one process creates and the others read: process 0 first (a shared run_dir).
        with primary_first("tmax-jax train: run dir"):
            prepare_run_dir(cfg)
            init = policy_checkpoint(cfg, self.run_dir)
            self.train_tasks, self.heldout_tasks = load_task_sets(cfg, self.run_dir)
        self.tokenizer = load_tokenizer(init)
        self.chat = make_chat(self.tokenizer, cfg.agent)  # agent.harness decides the tools in the prompt
        _log(f"{len(self.train_tasks)} train tasks, {len(self.heldout_tasks)} held-out; policy from {init}")
        self.mesh = make_mesh(cfg.mesh)

        init = self._warm_start(init)
        self.policy_init = init
        model = load_hf(
            init, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, remat=cfg.rl.train_step.remat
        )
        self.train_step = TrainStep(model, cfg.rl, self.mesh, cfg.mesh)
        if self.train_step.rows_multiple % self.nproc:
            raise ConfigError(
                f"data * fsdp * micro_batches = {self.train_step.rows_multiple} must be divisible by the "
                f"{self.nproc} JAX processes (each feeds the same number of rows)"
            )
        self.ckpt = TrainCheckpointer(
            self.run_dir / "checkpoints", save_every=cfg.save_every, keep=cfg.keep_checkpoints
        )
        restored = self.ckpt.restore_latest(self.train_step.abstract_state())
        if restored is None:
            self.state = self.train_step.init_state(seed=cfg.seed)
            self.data_state = None
            self.start_step = 0
        else:
            self.start_step, self.state, saved = restored
            self.data_state = self._own_loader_state(saved)
            _log(f"resumed from checkpoint step {self.start_step}")
        # One JAX process: the engine samples with the train shardings on every device. Several: each
        # process's engine holds a full copy on its own devices, refreshed after every step.
        self.replicas = ProcessReplicas(self.state.params, cfg.mesh) if self.nproc > 1 else None
        engine_model = nnx.merge(
            self.train_step.graphdef, self._engine_params(as_state=False), self.train_step.rest
        )
        self.engine = Engine(
            engine_model,
            max_concurrent_decodes=cfg.engine.slots,
            max_cache_length=cfg.engine.max_cache_length,
            max_prefill_length=cfg.engine.max_prefill_length,
            cache_dtype=jnp.dtype(cfg.engine.cache_dtype),
            eos_token_ids=[self.chat.end_id],
            tokenizer=self.tokenizer,
        )
        self.engine.update_params(self.engine.params, version=self.start_step)
        self._start_workers()
        records = [{"task_id": str(i), "instruction": t.instruction} for i, t in enumerate(self.train_tasks)]
        self.loader = PromptLoader(
            records,
            cfg.prompts_per_step // self.nproc,
            DataConfig(seed=cfg.seed),
            shard_index=self.pid,
            shard_count=self.nproc,
        )
        # The curriculum (train/curriculum.py) replaces the loader's order when enabled.
        self.curriculum = self.active = None
        self._curriculum_metrics: dict[int, dict] = {}
        if cfg.curriculum.enabled:
            from tmax_jax.train.curriculum import ActiveSampler, Curriculum

            self.curriculum = Curriculum(len(self.train_tasks), cfg.curriculum)
            if isinstance(self.data_state, dict) and "curriculum" in self.data_state:
                self.curriculum.load_state_dict(self.data_state["curriculum"])
            self.active = ActiveSampler(
                self.curriculum,
                cfg.prompts_per_step // self.nproc,
                cfg.seed,
                process_index=self.pid,
                process_count=self.nproc,
            )
        elif self.data_state:
            self.loader.set_state(self.data_state)
        self.metrics = MetricsWriter(self.run_dir, enabled=is_primary())
        self.metrics.truncate_after(self.start_step)

    def _own_loader_state(self, saved: dict) -> dict | None:
        """This process's prompt-loader position from a checkpoint's data item."""
        if "loaders" not in saved:  # written before per-process loader states
            return saved.get("loader")
        loaders = saved["loaders"]
        if len(loaders) != self.nproc:
            raise ConfigError(
                f"the checkpoint in {self.run_dir} was written by {len(loaders)} JAX process(es), this run "
                f"has {self.nproc}: the prompt shards differ; resume with {len(loaders)} process(es)"
            )
        return loaders[self.pid]

    def _save(self, step: int, loader_state: dict | None, *, force: bool = False) -> None:
        """Checkpoint ``step`` when the interval (or ``force``) says so, with every process's loader position."""
        if not force and step % self.cfg.save_every:
            return
        loaders = allgather_json(loader_state)  # same decision on every process: all enter it
        self.ckpt.save(step, self.state, {"loaders": loaders, "version": step}, force=True)

    def _start_workers(self) -> None:
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
            require_submit=cfg.reward_requires_submit,
        )

    def _engine_params(self, *, as_state: bool = True):
        """A copy of the current params for the engine (the train step donates its own); with
        several processes, this process's full copy (a collective: every process calls it)."""
        params = self.state.params
        with serial_launch():
            params = jax.tree.map(jnp.copy, params) if self.replicas is None else self.replicas(params)
        if not as_state:
            return params
        return nnx.state(nnx.merge(self.train_step.graphdef, params, self.train_step.rest))

    def _warm_start(self, init: Path) -> Path:
        """SFT on demonstrations into RUN_DIR/sft (once); returns the checkpoint RL starts from."""
        from tmax_jax.train.sft import run_sft

        sc = self.cfg.sft
        out = self.run_dir / "sft"
        if sc.steps == 0:
            return init
        if (out / "DONE").is_file():
            return out
        t0 = time.monotonic()
        # Each process replays its share of the solutions; all then train on all of them.
        demos, rejected = demonstrations(
            (self.train_tasks * sc.demos_per_task)[self.pid :: self.nproc],
            self.chat,
            self.cfg.agent,
            self.cfg.sandbox,
            workers=self.cfg.rollout_workers,
        )
        if self.nproc > 1:
            from collections import Counter

            from tmax_jax.agent.trajectory import Trajectory

            shares = allgather_json([[d.to_json() for d in demos], dict(rejected)])
            demos = [Trajectory.from_json(d) for share, _ in shares for d in share]
            rejected = sum((Counter(r) for _, r in shares), Counter())
        if not demos:
            raise TmaxError(
                "SFT warm start: no task produced a passing demonstration (check the tasks' solutions); "
                f"rejected: {dict(rejected)}"
            )
        _log(f"SFT: {len(demos)} demonstrations in {time.monotonic() - t0:.1f}s; {sc.steps} steps")
        summary = run_sft(init, demos, out, self.cfg, mesh=self.mesh, progress=self.progress, log=_log)
        if is_primary():
            (out / "DONE").write_text(json.dumps(summary))
        barrier("tmax-jax train: sft done")
        return out

    # ------------------------------------------------------------------ rollouts
    def _producer(self) -> None:
        cfg = self.cfg
        index = self.start_step
        try:
            while not self._stop.is_set() and index < cfg.steps:
                with self._step_cv:
                    # Bounded lead: batch `index` may start once the trainer reached index - async_steps.
                    while index - self._trainer_step > cfg.max_staleness and not self._stop.is_set():
                        self._step_cv.wait(0.5)
                if self._stop.is_set():
                    break
                t0 = time.monotonic()
                if self.active is not None:
                    groups = self._curriculum_groups(index)
                    data_state = {"curriculum": self.curriculum.state_dict()}
                    self.queue.put(RolloutBatch(index, groups, data_state, rollout_s=time.monotonic() - t0))
                    index += 1
                    continue
                records = self.loader.next_batch()
                data_state = self.loader.get_state()
                tasks = [self.train_tasks[int(r["task_id"])] for r in records]
                # Prompt p of this process is prompt first + p of the step (seeds and group ids are global).
                first = self.pid * (cfg.prompts_per_step // self.nproc)
                keys = [(cfg.seed, index, first + p) for p in range(len(tasks))]
                gids = [index * cfg.prompts_per_step + first + p for p in range(len(tasks))]
                groups = self.workers.groups(tasks, cfg.group_size, keys, gids)
                self.queue.put(RolloutBatch(index, groups, data_state, rollout_s=time.monotonic() - t0))
                index += 1
        except QueueClosed:
            pass
        except BaseException as e:  # surfaced by the trainer loop
            self._producer_error = e
            self.queue.close()

    def _curriculum_groups(self, index: int) -> list:
        """Step ``index``'s groups by active sampling; its curriculum metrics are kept for the trainer."""
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

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        """The whole run. SIGINT/SIGTERM (Ctrl-C) stop it at any stage: during RL it saves the step
        reached and returns ``{"interrupted": True, "step": N}``; earlier (warm start, the first eval)
        or later (the final eval) it raises KeyboardInterrupt. Either way no episode, sandbox or
        worker thread outlives it."""
        self._interrupts = _Interrupts(collective=self.nproc > 1)
        self._interrupts.install()
        try:
            return self._run()
        except KeyboardInterrupt:
            _log("interrupted")
            raise
        finally:
            self._interrupts.restore()

    def _run(self) -> dict:
        try:
            self._build()
            cfg = self.cfg
            summary_path = self.run_dir / "summary.json"
            before_path = self.run_dir / "eval_before.json"
            if before_path.is_file():
                before = json.loads(before_path.read_text())
            else:
                _log(
                    f"held-out pass rate before RL ({len(self.heldout_tasks)} tasks x {cfg.eval.samples_per_task})"
                )
                before = self.workers.pass_rate(self.heldout_tasks, cfg.eval.samples_per_task, cfg.seed)
                if is_primary():
                    before_path.write_text(json.dumps(before))
        except BaseException:
            self._stop_workers(now=True)
            raise
        _log(f"before: pass rate {before['pass_rate']:.3f}")

        self.queue = RolloutQueue(capacity=max(cfg.max_staleness, 1), max_staleness=cfg.max_staleness)
        self._producer_error = None
        self._trainer_step = self.start_step
        producer = threading.Thread(target=self._producer, name="tmax-rollouts", daemon=True)
        interrupted = False
        producer.start()
        bar = progress_bar(cfg.steps, "rl", self.progress, initial=self.start_step)
        step = self.start_step
        data_state = self.data_state  # the loader position after the last trained step's batch
        unwritten = None  # metrics of a trained step whose row is not in metrics.jsonl yet
        try:
            # Several processes stop together: a signal is held until the next step boundary, where
            # all of them learn whether any process got one (one process leaving would hang the rest).
            with self._interrupts.deferred() if self.nproc > 1 else contextlib.nullcontext():
                while step < cfg.steps:
                    t_wait = time.monotonic()
                    try:
                        batch = self.queue.get(current_version=step)
                    except QueueClosed:
                        raise TmaxError(
                            f"rollout worker failed: {self._producer_error!r}"
                        ) from self._producer_error
                    wait_s = time.monotonic() - t_wait
                    t_train = time.monotonic()
                    # The step donates the train state: an interrupt must not land between the update
                    # and the bookkeeping that makes it the state of `step`.
                    with self._interrupts.deferred():
                        metrics = self._train_on(batch, step)
                        metrics.update(self._curriculum_metrics.pop(batch.index, {}))
                        step += 1
                        data_state = batch.data_state
                        t_sync = time.monotonic()
                        self.engine.update_params(jax.block_until_ready(self._engine_params()), version=step)
                        sync_s = time.monotonic() - t_sync
                        with self._step_cv:
                            self._trainer_step = step
                            self._step_cv.notify_all()
                        metrics.update(
                            trainer_wait_s=wait_s,
                            train_s=time.monotonic() - t_train,
                            rollout_s=batch.rollout_s,
                            weight_sync_s=sync_s,  # the engine's copy (all hosts: a reshard over the slice)
                            # waiting for the launch lock (tmax_jax.launch; 0 where it is off, e.g. CPU)
                            launch_wait_s=launch_stats(reset=True)["launch_wait_s"],
                            **self.workers.stats.snapshot_and_reset(),
                        )
                        unwritten = metrics
                    if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
                        ev = self.workers.pass_rate(self.heldout_tasks, cfg.eval.samples_per_task, cfg.seed)
                        metrics["heldout_pass_rate"] = ev["pass_rate"]
                    with self._interrupts.deferred():
                        self.metrics.write(step, metrics)
                        unwritten = None
                        # The last step always: the final eval may yet be interrupted, and export-hf wants it.
                        self._save(step, data_state, force=step == cfg.steps)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(
                            reward=f"{metrics['reward_mean']:.2f}",
                            pass_=f"{metrics['pass_rate']:.2f}",
                            masked=f"{metrics.get('masked_fraction', 0.0):.3f}",
                            gap=f"{metrics.get('max_abs_logprob_diff', 0.0):.2g}",
                            mm=f"{metrics.get('mismatch/max_abs_logprob_diff', 0.0):.2g}",
                            stale=f"{metrics.get('staleness/off_policy_fraction', 0.0):.2f}",
                        )
                    self._interrupts.step_boundary()
        except KeyboardInterrupt:
            interrupted = True
            _log(f"interrupted: saving step {step} and exiting")
            # Stop the rollouts first: their sandboxes are killed, so nothing below waits on them.
            self._stop_workers(now=True)
            if unwritten is not None:
                self.metrics.write(step, unwritten)
            if step > self.start_step and step not in self.ckpt.steps():
                self._save(step, data_state, force=True)
        finally:
            if bar is not None:
                bar.close()
            self._stop.set()
            self.queue.close()
            self._stop_workers(now=False)
            producer.join(timeout=60)
            self.ckpt.close()
            self.metrics.close()
        if interrupted:
            return {"interrupted": True, "step": step}
        _log("held-out pass rate after RL")
        after = self._final_eval()
        summary = self._summary(before, after, step)
        if is_primary():
            summary_path.write_text(json.dumps(summary, indent=2))
            self._plot(before, after)
            from tmax_jax.eval.html_report import render_before_after_html

            (self.run_dir / "eval_report.html").write_text(render_before_after_html(summary))
        _log(
            f"done: pass rate {summary['pass_rate_before']:.3f} -> {summary['pass_rate_after']:.3f} "
            f"({summary['steps']} steps); summary in {summary_path}"
        )
        return summary

    def _final_eval(self) -> dict:
        # The rollout workers were shut down with the loop; evaluate with fresh ones.
        self._start_workers()
        try:
            return self.workers.pass_rate(self.heldout_tasks, self.cfg.eval.samples_per_task, self.cfg.seed)
        except BaseException:
            self._stop_workers(now=True)
            raise
        finally:
            self._stop_workers(now=False)

    def _stop_workers(self, *, now: bool) -> None:
        """Shut the rollout workers and the orchestrator down (idempotent). ``now`` (an interrupt or an
        error) also cancels queued episodes and kills the process's sandboxes, so running episodes end
        at their next command or token instead of playing out."""
        workers, orch = getattr(self, "workers", None), getattr(self, "orch", None)
        if workers is not None:
            workers.stopping.set()
        if now:
            from tmax_jax.sandbox import registry

            if orch is not None:
                orch.stop()
            registry.close_all()
        if workers is not None:
            workers.close()
        if orch is not None:
            orch.stop()

    def trajectory_file(self, step: int) -> Path:
        """Where the episodes trained on at ``step`` are written (one file per process when several)."""
        part = f".p{self.pid}" if self.nproc > 1 else ""
        return self.run_dir / "trajectories" / f"step_{step:06d}{part}.jsonl"

    def _train_on(self, batch: RolloutBatch, step: int) -> dict:
        from tmax_jax.rl.advantages import group_advantages
        from tmax_jax.rl.packing import pack_trajectories
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
        packed = pad_rows_across_processes(packed, self.train_step.rows_multiple)
        t0 = time.monotonic()
        self.state, m = self.train_step(self.state, packed)
        m = {k: float(v) for k, v in m.items()}
        dt = time.monotonic() - t0
        metrics.update(m)
        metrics["skipped_update"] = 0
        metrics["train_tokens_per_s"] = float(sum(tokens[i] - 1 for i in kept)) / max(dt, 1e-9)
        return metrics

    def _summary(self, before: dict, after: dict, step: int) -> dict:
        rows = self.metrics.read()
        return {
            "run_dir": str(self.run_dir),
            "steps": step,
            "policy_init": str(self.policy_init),
            "harness": self.cfg.agent.harness,
            "pass_rate_before": before["pass_rate"],
            "pass_rate_after": after["pass_rate"],
            "reward_before": before["reward_mean"],
            "reward_after": after["reward_mean"],
            "heldout_tasks": len(self.heldout_tasks),
            "samples_per_task": self.cfg.eval.samples_per_task,
            "train_pass_rate_per_step": [r.get("pass_rate") for r in rows],
            "heldout_pass_rate_per_eval": [
                [r["step"], r["heldout_pass_rate"]] for r in rows if r.get("heldout_pass_rate") is not None
            ],
            "episode_turns_mean": float(np.mean([r["episode_turns_mean"] for r in rows])) if rows else None,
            "heldout_turns_mean_after": after.get("turns_mean"),
            **{
                f"pass_rate_{k}": v for k, v in pass_rates_by_group(self.heldout_tasks, before, after).items()
            },
        }

    def _plot(self, before: dict, after: dict) -> None:
        rows = self.metrics.read()
        series = {
            "train pass rate": [(r["step"], r["pass_rate"]) for r in rows if r.get("pass_rate") is not None]
        }
        held = [(0, before["pass_rate"])] + [
            (r["step"], r["heldout_pass_rate"]) for r in rows if r.get("heldout_pass_rate") is not None
        ]
        held.append((rows[-1]["step"] if rows else 0, after["pass_rate"]))
        series["held-out pass rate"] = held
        line_chart(self.run_dir / "learning_curve.png", series, title="tmax-jax DPPO: pass rate per step")


class _Interrupts:
    """SIGINT and SIGTERM as KeyboardInterrupt in the main thread, at once, except inside
    ``deferred()`` blocks, whose end raises it instead (a train step must not be cut between the
    update of its donated state and the bookkeeping of that update). Several processes hold the
    whole RL loop in one ``deferred()`` block and stop at ``step_boundary()`` together."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, *, collective: bool = False):
        self.collective = collective  # several JAX processes: they decide to stop together
        self.pending = False
        self._depth = 0
        self._previous: dict = {}

    def install(self) -> None:
        # Python lets only the main thread set handlers; elsewhere (a run in a thread) keep the defaults.
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self._depth:
            if not self.pending:
                _log(f"{signal.Signals(signum).name}: stopping after the current step")
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self.pending and not self._depth:
            raise KeyboardInterrupt

    def step_boundary(self) -> None:
        """Raise KeyboardInterrupt when a signal is pending here or, in collective mode, on any
        process (a collective: every process calls it once per step)."""
        if any_process(self.pending) if self.collective else self.pending:
            self.pending = True
            raise KeyboardInterrupt


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    return Trainer(cfg, progress=progress).run()


__all__ = ["Trainer", "train"]
