"""``build_run(cfg) -> Run``: everything a training run is made of, constructed once.

Run dir, task sets, tokenizer and chat format, mesh, the SFT warm start (once per run dir), the
policy and its train step, the checkpointer and the restored state, the engine, the prompt loader
or curriculum, the metrics writer, and the :class:`Learner` and :class:`Producer` over them. Nothing
here samples a rollout or takes a train step; ``tmax_jax.train.loop`` runs them.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from tmax_jax.agent.episode import make_chat
from tmax_jax.config import to_dict
from tmax_jax.data import DataConfig, PromptLoader
from tmax_jax.distributed import allgather_json, barrier, is_primary, primary_first
from tmax_jax.errors import ConfigError, TmaxError
from tmax_jax.train.config import TrainConfig
from tmax_jax.train.console import log
from tmax_jax.train.learner import Learner
from tmax_jax.train.metrics import MetricsWriter, require_wandb
from tmax_jax.train.mtp_fit import draft_fitter, draft_settings, resume_draft
from tmax_jax.train.producer import Producer
from tmax_jax.train.rollout import demonstrations
from tmax_jax.train.setup import load_task_sets, policy_checkpoint, prepare_run_dir


@dataclasses.dataclass
class Run:
    cfg: TrainConfig
    run_dir: Path
    pid: int
    nproc: int
    progress: bool
    train_tasks: list
    heldout_tasks: list
    policy_init: Path
    start_step: int
    data_state: dict | None  # this process's loader position after start_step's batches
    engine: Any
    learner: Learner
    producer: Producer
    metrics: MetricsWriter
    draft_fitter: Any = None  # engine.draft_fit_steps: keeps the MTP draft fitted to the policy


def build_run(cfg: TrainConfig, *, progress: bool = True) -> Run:
    from tmax_jax.checkpoints import load_hf
    from tmax_jax.engine.engine import Engine
    from tmax_jax.rl.state import TrainCheckpointer
    from tmax_jax.rl.train_step import TrainStep
    from tmax_jax.sharding import ProcessReplicas, make_mesh
    from tmax_jax.tokenizer import load_tokenizer

    pid, nproc = jax.process_index(), jax.process_count()
    run_dir = Path(cfg.run_dir)
    if cfg.prompts_per_step % nproc:
        raise ConfigError(
            f"prompts_per_step={cfg.prompts_per_step} must be divisible by the {nproc} JAX "
            "processes (each runs the same number of groups per step)"
        )
    require_wandb(cfg.logging)  # before any work, on every process
    # Files one process creates and the others read: process 0 first (a shared run_dir).
    with primary_first("tmax-jax train: run dir"):
        prepare_run_dir(cfg)
        init = policy_checkpoint(cfg, run_dir)
        train_tasks, heldout_tasks = load_task_sets(cfg, run_dir)
    tokenizer = load_tokenizer(init)
    chat = make_chat(tokenizer, cfg.agent)  # agent.harness decides the tools in the prompt
    log(f"{len(train_tasks)} train tasks, {len(heldout_tasks)} held-out; policy from {init}")
    mesh = make_mesh(cfg.mesh)
    progress = progress and is_primary()

    # From the checkpoint RL starts from, before any SFT (whose export carries the module through).
    draft = draft_settings(cfg, init, mesh if nproc == 1 else None)
    init = warm_start(cfg, init, train_tasks, chat, mesh, progress=progress)
    model = load_hf(
        init,
        dtype=cfg.model.dtype,
        param_dtype=cfg.model.param_dtype,
        remat=cfg.rl.train_step.remat,
        **cfg.model.runtime_choices(),
    )
    train_step = TrainStep(model, cfg.rl, mesh, cfg.mesh)
    if train_step.rows_multiple % nproc:
        raise ConfigError(
            f"data * fsdp * micro_batches = {train_step.rows_multiple} must be divisible by the "
            f"{nproc} JAX processes (each feeds the same number of rows)"
        )
    ckpt = TrainCheckpointer(run_dir / "checkpoints", save_every=cfg.save_every, keep=cfg.keep_checkpoints)
    restored = ckpt.restore_latest(train_step.abstract_state())
    if restored is None:
        start_step, state, data_state = 0, train_step.init_state(seed=cfg.seed), None
    else:
        start_step, state, saved = restored
        data_state = _own_loader_state(saved, run_dir, pid, nproc)
        log(f"resumed from checkpoint step {start_step}")
    # One JAX process: the engine samples with the train shardings on every device. Several: each
    # process's engine holds a full copy on its own devices, refreshed after every step.
    replicas = ProcessReplicas(state.params, cfg.mesh) if nproc > 1 else None
    learner = Learner(
        cfg,
        train_step,
        ckpt,
        state,
        start_step=start_step,
        run_dir=run_dir,
        replicas=replicas,
        pid=pid,
        nproc=nproc,
    )
    engine = Engine(
        learner.engine_model(),
        max_concurrent_decodes=cfg.engine.slots,
        max_cache_length=cfg.engine.max_cache_length,
        max_prefill_length=cfg.engine.max_prefill_length,
        cache_dtype=jnp.dtype(cfg.engine.cache_dtype),
        eos_token_ids=[chat.end_id],
        tokenizer=tokenizer,
        record_routing=train_step.routing_replay,  # the experts the train step replays
        **draft,
    )
    learner.connect(engine)
    fitter = draft_fitter(cfg, learner, draft.get("mtp"), nproc)
    if fitter is not None:
        learner.draft_fitter = fitter
        if restored is not None:
            resume_draft(fitter, ckpt, start_step, engine)
    records = [{"task_id": str(i), "instruction": t.instruction} for i, t in enumerate(train_tasks)]
    loader = PromptLoader(
        records, cfg.prompts_per_step // nproc, DataConfig(seed=cfg.seed), shard_index=pid, shard_count=nproc
    )
    # The curriculum (train/curriculum.py) replaces the loader's order when enabled.
    active = None
    if cfg.curriculum.enabled:
        from tmax_jax.train.curriculum import ActiveSampler, Curriculum

        curriculum = Curriculum(len(train_tasks), cfg.curriculum)
        if isinstance(data_state, dict) and "curriculum" in data_state:
            curriculum.load_state_dict(data_state["curriculum"])
        active = ActiveSampler(
            curriculum, cfg.prompts_per_step // nproc, cfg.seed, process_index=pid, process_count=nproc
        )
    elif data_state:
        loader.set_state(data_state)
    metrics = MetricsWriter(run_dir, logging=cfg.logging, run_config=to_dict(cfg), enabled=is_primary())
    metrics.truncate_after(start_step)
    # Last: the producer starts the rollout workers (threads, sandboxes), so nothing after it can fail.
    producer = Producer(cfg, engine, tokenizer, chat, train_tasks, loader, active, pid=pid, nproc=nproc)
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        pid=pid,
        nproc=nproc,
        progress=progress,
        train_tasks=train_tasks,
        heldout_tasks=heldout_tasks,
        policy_init=init,
        start_step=start_step,
        data_state=data_state,
        engine=engine,
        learner=learner,
        producer=producer,
        metrics=metrics,
        draft_fitter=fitter,
    )


def _own_loader_state(saved: dict, run_dir: Path, pid: int, nproc: int) -> dict | None:
    """This process's prompt-loader position from a checkpoint's data item."""
    if "loaders" not in saved:  # written before per-process loader states
        return saved.get("loader")
    loaders = saved["loaders"]
    if len(loaders) != nproc:
        raise ConfigError(
            f"the checkpoint in {run_dir} was written by {len(loaders)} JAX process(es), this run "
            f"has {nproc}: the prompt shards differ; resume with {len(loaders)} process(es)"
        )
    return loaders[pid]


def warm_start(
    cfg: TrainConfig, init: Path, train_tasks: list, chat: Any, mesh: Any, *, progress: bool
) -> Path:
    """SFT on demonstrations into RUN_DIR/sft (once); returns the checkpoint RL starts from."""
    from tmax_jax.train.sft import run_sft

    sc = cfg.sft
    out = Path(cfg.run_dir) / "sft"
    if sc.steps == 0:
        return init
    if (out / "DONE").is_file():
        return out
    pid, nproc = jax.process_index(), jax.process_count()
    t0 = time.monotonic()
    # Each process replays its share of the solutions; all then train on all of them.
    demos, rejected = demonstrations(
        (train_tasks * sc.demos_per_task)[pid::nproc],
        chat,
        cfg.agent,
        cfg.sandbox,
        workers=cfg.rollout_workers,
    )
    if nproc > 1:
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
    log(f"SFT: {len(demos)} demonstrations in {time.monotonic() - t0:.1f}s; {sc.steps} steps")
    summary = run_sft(init, demos, out, cfg, mesh=mesh, progress=progress, log=log)
    if is_primary():
        (out / "DONE").write_text(json.dumps(summary))
    barrier("tmax-jax train: sft done")
    return out
