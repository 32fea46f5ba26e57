"""What a run needs before its first step: the policy checkpoint, the task sets, the run directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from tmax_jax.config import override, to_dict
from tmax_jax.distributed import is_primary
from tmax_jax.errors import ConfigError, TaskFormatError
from tmax_jax.tasks import load_task
from tmax_jax.tasks.loader import find_tasks
from tmax_jax.tasks.model import Task
from tmax_jax.train.config import TrainConfig
from tmax_jax.train.demo_tasks import WORDS, write_tasks

PROCEDURAL_FAMILIES = {"write_word"}

# Fields that may change when a run is resumed (extending a run, moving it, or new hosts after a
# preemption); ``plan`` only describes the hardware ``tmax-jax plan`` checks against.
RESUMABLE_CHANGES = {
    "steps",
    "run_dir",
    "save_every",
    "keep_checkpoints",
    "rollout_workers",
    "plan",
    "distributed",
}


def enable_compilation_cache() -> str:
    """Keep compiled train/engine steps on disk, so a resumed or repeated run skips recompiling.

    Each distinct packed-row count compiles the train step once (tens of seconds on a laptop CPU);
    JAX's persistent cache makes that a one-time cost per machine. ``JAX_COMPILATION_CACHE_DIR``
    wins when set (the TPU launcher sets it); otherwise ``~/.cache/tmax-jax/jax``.
    """
    import jax

    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(Path.home() / ".cache" / "tmax-jax" / "jax")
    jax.config.update("jax_compilation_cache_dir", path)
    # Only executables that took a while to build are worth a disk entry.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
    return path


def prepare_run_dir(cfg: TrainConfig) -> Path:
    """Create the run dir and write ``config.yaml``; on resume, refuse a config that changed."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    new = to_dict(cfg)
    if path.exists():
        old = yaml.safe_load(path.read_text()) or {}
        try:  # a run written before a field existed holds its default
            old = to_dict(override(TrainConfig(), old))
        except ConfigError:
            pass  # a field since removed: compare as written
        changed = sorted(
            k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES
        )
        if changed:
            raise ConfigError(
                f"{run_dir} holds a run with a different config (changed: {', '.join(changed)}); "
                "use a new --run-dir or the same config to resume"
            )
    if is_primary():  # the others of a pod only check (their distributed.process_id differs)
        path.write_text(yaml.safe_dump(new, sort_keys=False))
    return run_dir


def _tokenizer_corpus(cfg: TrainConfig) -> list[str]:
    from tmax_jax.agent.protocol import BASH_TOOL, SUBMIT_MARKER, render_tool_call
    from tmax_jax.tokenizer import _CORPUS

    demo = [f"Write the word {w} into the file /app/answer.txt." for w in WORDS]
    demo += [render_tool_call(f"echo {w} > /app/answer.txt") for w in WORDS]
    demo += [
        render_tool_call(f"echo {SUBMIT_MARKER}"),
        cfg.agent.system_prompt,
        str(BASH_TOOL),
        "(exit_code=0)",
    ]
    return list(_CORPUS) * 4 + demo * 8


# Qwen35Config fields that decide parameter shapes: a checkpoint must match the planned model in these.
_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "layer_types",
    "tie_word_embeddings",
    "attention_bias",
)


def policy_checkpoint(cfg: TrainConfig, run_dir: Path) -> Path:
    """The HF checkpoint RL starts from: the configured one, or a random tiny one made once per run."""
    if cfg.model.checkpoint:
        path = Path(cfg.model.checkpoint)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.checkpoint {path} is not a checkpoint directory (no config.json)")
        if cfg.model.preset or cfg.model.overrides:
            _check_shape(cfg, path)
        return path
    if cfg.model.preset.lower() not in ("", "tiny"):
        raise ConfigError(
            f"model.preset={cfg.model.preset!r} needs model.checkpoint (a Qwen 3.5 HF directory); "
            "without one train only creates a random tiny model"
        )
    init = run_dir / "init"
    if not (init / "model.safetensors").is_file() and not (init / "model.safetensors.index.json").is_file():
        from tmax_jax.checkpoints.tiny import write_tiny_checkpoint

        write_tiny_checkpoint(
            init, seed=cfg.model.init_seed, corpus=_tokenizer_corpus(cfg), base=cfg.model.shape()
        )
    return init


def _check_shape(cfg: TrainConfig, path: Path) -> None:
    """The memory plan was made for model.preset + model.overrides: refuse a checkpoint of another shape."""
    from tmax_jax.checkpoints.load import read_hf_config

    have, want = read_hf_config(path), cfg.model.shape()
    diff = [
        f"{k}: {getattr(have, k)} != {getattr(want, k)}"
        for k in _SHAPE_FIELDS
        if getattr(have, k) != getattr(want, k)
    ]
    if diff:
        raise ConfigError(
            f"model.checkpoint {path} does not have the shape of model.preset={cfg.model.preset!r} "
            f"with model.overrides ({'; '.join(diff)}); fix the preset or clear it"
        )


def load_task_sets(cfg: TrainConfig, run_dir: Path) -> tuple[list[Task], list[Task]]:
    """(train, held-out) tasks. Procedural tasks are written once into RUN_DIR/tasks; held-out seeds
    are disjoint from training seeds."""
    if cfg.tasks.dir:
        paths = find_tasks(cfg.tasks.dir)
        tasks = []
        for p in paths:
            try:
                tasks.append(load_task(p))
            except TaskFormatError as e:
                print(f"tmax-jax train: skipping malformed task {p}: {e}", file=sys.stderr)
        if len(tasks) < 2:
            raise ConfigError(f"tasks.dir {cfg.tasks.dir} has {len(tasks)} usable task(s); need at least 2")
        n_held = min(cfg.tasks.num_heldout, len(tasks) // 4)
        return tasks[n_held:], tasks[:n_held]
    unknown = [f for f in cfg.tasks.families if f not in PROCEDURAL_FAMILIES]
    if unknown:
        raise ConfigError(f"tasks.families: unknown {unknown} (known: {sorted(PROCEDURAL_FAMILIES)})")
    root = run_dir / "tasks"
    base = cfg.tasks.seed * 1_000_000
    train_seeds = range(base, base + cfg.tasks.num_train)
    held_seeds = range(base + 500_000, base + 500_000 + cfg.tasks.num_heldout)
    if not 1 <= cfg.tasks.words <= len(WORDS):
        raise ConfigError(f"tasks.words must be in [1, {len(WORDS)}], got {cfg.tasks.words}")
    if not (root / "train").is_dir():
        write_tasks(root / "train", train_seeds, num_words=cfg.tasks.words)
        write_tasks(root / "heldout", held_seeds, num_words=cfg.tasks.words)
    train = [load_task(p) for p in sorted((root / "train").iterdir())]
    held = [load_task(p) for p in sorted((root / "heldout").iterdir())]
    return train, held
