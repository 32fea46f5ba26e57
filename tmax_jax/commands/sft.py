"""``tmax-jax sft --checkpoint DIR --out DIR (--tasks DIR | --trajectories FILE ...)``: an SFT warm
start on successful trajectories, written as an HF checkpoint (the trainer's warm start, standalone)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

# Without --config, the SFT settings of a run whose warm start is on.
DEFAULT_STEPS = 100


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sft",
        help="supervised warm start on successful trajectories (reference solutions or saved episodes)",
        description=(
            "Fine-tune an HF checkpoint on the policy tokens of successful trajectories and write the "
            "result to --out (an HF directory, with sft_summary.json). --tasks replays every task's "
            "reference solution through the agent harness in a sandbox and keeps those the verifier "
            "passes (as `tmax-jax train`'s warm start does); --trajectories reads JSONL written by "
            "`tmax-jax train` (RUN_DIR/trajectories/*.jsonl) and keeps reward >= --min-reward."
        ),
    )
    p.add_argument("--checkpoint", required=True, type=Path, help="HF checkpoint directory to start from")
    p.add_argument("--out", required=True, type=Path, help="output HF checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tasks", type=Path, help="Harbor/TMAX task directory (searched recursively)")
    src.add_argument("--trajectories", type=Path, nargs="+", metavar="FILE", help="trajectory JSONL files")
    p.add_argument(
        "--config",
        help="a train config YAML whose agent, sandbox, rl, mesh, model dtypes and sft settings to use "
        "(the same harness the RL run will see); flags below override its sft section",
    )
    p.add_argument(
        "--steps", type=int, help=f"optimizer steps (default: config's sft.steps, or {DEFAULT_STEPS})"
    )
    p.add_argument("--batch-size", type=int, help="trajectories per step")
    p.add_argument("--lr", type=float, help="learning rate (constant)")
    p.add_argument("--seq-len", type=int, help="packed row length; longer trajectories are skipped")
    p.add_argument(
        "--min-reward", type=float, default=1.0, help="--trajectories: keep reward >= this (default 1.0)"
    )
    p.add_argument("--seed", type=int, help="batch sampling seed (default: config's seed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _config(args: argparse.Namespace):
    from tmax_jax.errors import ConfigError
    from tmax_jax.train.config import load_train_config

    cfg = load_train_config(args.config)
    sft = cfg.sft if args.config and cfg.sft.steps else dataclasses.replace(cfg.sft, steps=DEFAULT_STEPS)
    flags = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "learning_rate": args.lr,
        "seq_len": args.seq_len,
    }
    sft = dataclasses.replace(sft, **{k: v for k, v in flags.items() if v is not None})  # checks the values
    if sft.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {sft.steps}")
    seed = cfg.seed if args.seed is None else args.seed
    return dataclasses.replace(cfg, sft=sft, seed=seed)


def _log(msg: str) -> None:
    print(f"[tmax-jax sft] {msg}", file=sys.stderr, flush=True)


def _demonstrations(args, cfg, tokenizer) -> list:
    from tmax_jax.agent.episode import make_chat
    from tmax_jax.errors import TaskFormatError, TmaxError
    from tmax_jax.tasks import find_tasks, load_task
    from tmax_jax.train.rollout import demonstrations

    tasks = []
    for path in find_tasks(args.tasks):
        try:
            tasks.append(load_task(path))
        except TaskFormatError as e:
            _log(f"skipping malformed task {path}: {e}")
    if not tasks:
        raise TmaxError(f"--tasks {args.tasks}: no usable task")
    # The prompt exactly as the trainer renders it, so SFT and RL see the same tokens.
    chat = make_chat(tokenizer, cfg.agent)
    demos, rejected = demonstrations(
        tasks * cfg.sft.demos_per_task, chat, cfg.agent, cfg.sandbox, workers=cfg.rollout_workers
    )
    _log(f"{len(demos)} passing demonstrations from {len(tasks)} tasks; rejected: {dict(rejected) or 'none'}")
    if not demos:
        raise TmaxError(f"--tasks {args.tasks}: no task's reference solution passed its verifier")
    return demos


def run(args: argparse.Namespace) -> int:
    from tmax_jax.checkpoints import read_hf_config
    from tmax_jax.compilation_cache import enable_compilation_cache
    from tmax_jax.distributed import synchronous_cpu_dispatch
    from tmax_jax.tokenizer import load_tokenizer
    from tmax_jax.train.sft import run_sft, successful_trajectories

    cfg = _config(args)
    vocab = read_hf_config(args.checkpoint).vocab_size  # names a missing checkpoint or config.json
    tokenizer = load_tokenizer(args.checkpoint)
    if args.trajectories:
        data, counts = successful_trajectories(
            args.trajectories, min_reward=args.min_reward, vocab_size=vocab
        )
        for path, (read, kept) in counts.items():
            _log(f"{path}: {kept} of {read} trajectories with reward >= {args.min_reward}")
    else:
        data = _demonstrations(args, cfg, tokenizer)
    # As in `tmax-jax train`: donated train states under CPU async dispatch can stall, and a
    # repeated run reuses the compiled step.
    synchronous_cpu_dispatch()
    enable_compilation_cache()
    summary = run_sft(args.checkpoint, data, args.out, cfg, progress=not args.no_progress, log=_log)
    print(json.dumps(summary))
    return 0
