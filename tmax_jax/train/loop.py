"""``tmax-jax train``: warm start, then asynchronous DPPO with rollouts in sandboxes.

One JAX process runs everything: the :class:`~tmax_jax.train.producer.Producer`'s rollout workers
(episode threads over the sandbox pool and the engine's orchestrator) produce one batch of groups
per step, up to ``async_steps`` ahead; the :class:`~tmax_jax.train.learner.Learner` takes them in
order (stale groups dropped, flat groups soft-filtered), computes group advantages, packs the
trajectories into rows, runs the jitted DPPO step and pushes the new weights to the engine (no
recompilation; episodes in flight continue with the new weights, and every token records the version
that sampled it). Checkpoints (orbax) carry the train state and the prompt loader position, so a
killed run resumes at the step after its last checkpoint. ``build_run`` (train/run.py) constructs
everything; this module is the loop that joins producer and learner, with its interrupts.

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
import time

from tmax_jax.compilation_cache import enable_compilation_cache
from tmax_jax.distributed import is_primary, synchronous_cpu_dispatch
from tmax_jax.train.config import TrainConfig
from tmax_jax.train.console import log
from tmax_jax.train.interrupts import Interrupts
from tmax_jax.train.metrics import progress_bar
from tmax_jax.train.mtp_fit import refit_draft
from tmax_jax.train.producer import kill_sandboxes
from tmax_jax.train.report import write_report
from tmax_jax.train.run import Run, build_run

_Interrupts = Interrupts  # the name tests and older callers use


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """The whole run. SIGINT/SIGTERM (Ctrl-C) stop it at any stage: during RL it saves the step
    reached and returns ``{"interrupted": True, "step": N}``; earlier (warm start, the first eval)
    or later (the final eval) it raises KeyboardInterrupt. Either way no episode, sandbox or
    worker thread outlives it."""
    import jax

    synchronous_cpu_dispatch()
    enable_compilation_cache()
    interrupts = Interrupts(collective=jax.process_count() > 1, log=log)
    interrupts.install()
    try:
        return _train(cfg, progress, interrupts)
    except KeyboardInterrupt:
        log("interrupted")
        raise
    finally:
        interrupts.restore()


def _train(cfg: TrainConfig, progress: bool, interrupts: Interrupts) -> dict:
    run = None
    try:
        run = build_run(cfg, progress=progress)
        before = _eval_before(run)
    except BaseException:
        # Sandboxes of the warm start or the first eval die with it.
        if run is not None:
            run.producer.stop_workers(now=True)
        else:
            kill_sandboxes()
        raise
    log(f"before: pass rate {before['pass_rate']:.3f}")
    step, interrupted = _rl(run, interrupts)
    if interrupted:
        return {"interrupted": True, "step": step}
    log("held-out pass rate after RL")
    after = run.producer.final_pass_rate(run.heldout_tasks)
    summary = write_report(run, before, after, step)
    log(
        f"done: pass rate {summary['pass_rate_before']:.3f} -> {summary['pass_rate_after']:.3f} "
        f"({summary['steps']} steps); summary in {run.run_dir / 'summary.json'}"
    )
    return summary


def _eval_before(run: Run) -> dict:
    path = run.run_dir / "eval_before.json"
    if path.is_file():
        return json.loads(path.read_text())
    log(f"held-out pass rate before RL ({len(run.heldout_tasks)} tasks x {run.cfg.eval.samples_per_task})")
    before = run.producer.pass_rate(run.heldout_tasks)
    if is_primary():
        path.write_text(json.dumps(before))
    return before


def _rl(run: Run, interrupts: Interrupts) -> tuple[int, bool]:
    """The RL steps from ``run.start_step``; returns (the step reached, whether interrupted)."""
    cfg, producer, learner = run.cfg, run.producer, run.learner
    producer.start(run.start_step)
    bar = progress_bar(cfg.steps, "rl", run.progress, initial=run.start_step)
    step = run.start_step
    data_state = run.data_state  # the loader position after the last trained step's batch
    unwritten = None  # metrics of a trained step whose row is not in metrics.jsonl yet
    try:
        # Several processes stop together: a signal is held until the next step boundary, where
        # all of them learn whether any process got one (one process leaving would hang the rest).
        with interrupts.deferred() if run.nproc > 1 else contextlib.nullcontext():
            while step < cfg.steps:
                t_wait = time.monotonic()
                batch = producer.next_batch(step)
                wait_s = time.monotonic() - t_wait
                # The step donates the train state: an interrupt must not land between the update
                # and the bookkeeping that makes it the state of `step`.
                with interrupts.deferred():
                    metrics = learner.step(batch, step)
                    step += 1
                    data_state = batch.data_state
                    producer.learner_reached(step)
                    metrics.update(
                        trainer_wait_s=wait_s, rollout_s=batch.rollout_s, **producer.step_stats(batch.index)
                    )
                    unwritten = metrics
                if run.draft_fitter is not None:
                    metrics.update(refit_draft(run, batch, step))
                if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
                    metrics["heldout_pass_rate"] = producer.pass_rate(run.heldout_tasks)["pass_rate"]
                with interrupts.deferred():
                    run.metrics.write(step, metrics)
                    unwritten = None
                    # The last step always: the final eval may yet be interrupted, and export-hf wants it.
                    learner.save(step, data_state, force=step == cfg.steps)
                _show(bar, metrics)
                interrupts.step_boundary()
    except KeyboardInterrupt:
        log(f"interrupted: saving step {step} and exiting")
        # Stop the rollouts first: their sandboxes are killed, so nothing below waits on them.
        producer.stop_workers(now=True)
        if unwritten is not None:
            run.metrics.write(step, unwritten)
        if step > run.start_step and not learner.saved(step):
            learner.save(step, data_state, force=True)
        return step, True
    finally:
        if bar is not None:
            bar.close()
        producer.close()
        learner.close()
        run.metrics.close()
    return step, False


def _show(bar, metrics: dict) -> None:
    if bar is None:
        return
    bar.update(1)
    bar.set_postfix(
        reward=f"{metrics['reward_mean']:.2f}",
        pass_=f"{metrics['pass_rate']:.2f}",
        masked=f"{metrics.get('masked_fraction', 0.0):.3f}",
        gap=f"{metrics.get('max_abs_logprob_diff', 0.0):.2g}",
        mm=f"{metrics.get('mismatch/max_abs_logprob_diff', 0.0):.2g}",
        stale=f"{metrics.get('staleness/off_policy_fraction', 0.0):.2f}",
    )


__all__ = ["Run", "build_run", "train"]
