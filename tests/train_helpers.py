"""`tmax-jax train` as a subprocess on a tiny config (shared by the kill/resume and interrupt tests)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]

# A run that reaches its first RL step in a few CPU minutes: 1 SFT step, 2 x 2 episodes of at most
# 2 turns x 24 tokens per step, 2 held-out tasks evaluated once.
TINY_ARGS = [
    "steps=3",
    "prompts_per_step=2",
    "group_size=2",
    "async_steps=1",
    "rollout_workers=4",
    "save_every=1",
    "seq_len=512",
    "tasks.num_train=8",
    "tasks.num_heldout=2",
    "eval.samples_per_task=1",
    "sft.steps=1",
    "sft.batch_size=4",
    "sft.seq_len=512",
    "agent.max_turns=2",
    "agent.max_tokens_per_turn=24",
    "agent.max_context_tokens=512",
    "engine.slots=8",
    "engine.max_cache_length=512",
    "engine.max_prefill_length=256",
]


def train_cmd(run_dir: Path, *overrides: str) -> list[str]:
    """``python -m tmax_jax train`` on configs/tiny-cpu.yaml + TINY_ARGS + ``overrides`` (later wins)."""
    cmd = [sys.executable, "-m", "tmax_jax", "train", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir)]
    cmd.append("--no-progress")
    for a in (*TINY_ARGS, *overrides):
        cmd += ["--set", a]
    return cmd


def train_env() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()  # one CPU device, as a user's laptop
    return env
