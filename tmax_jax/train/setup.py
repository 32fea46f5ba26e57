"""What a run needs before its first step: the policy checkpoint, the task sets, the run directory."""

from __future__ import annotations

import json
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
from tmax_jax.train.demo_tasks import DATA_FAMILIES, DEMO_FAMILIES, TRAIN_NAMES, WORDS, write_demo_task

# Fields that may change when a run is resumed (extending a run, moving it, or new hosts after a
# preemption); ``plan`` only describes the hardware ``tmax-jax plan`` checks against, and ``logging``
# only where the metrics are copied to.
RESUMABLE_CHANGES = {
    "steps",
    "run_dir",
    "save_every",
    "keep_checkpoints",
    "rollout_workers",
    "plan",
    "distributed",
    "logging",
}


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
    # The data-file families: the training names only (held-out names are split into known pieces).
    # largest_number always (the corpus the demo's tokenizer was first trained on), the others when
    # the run uses them.
    families = cfg.tasks.family_weights() if cfg.tasks.families else {}
    for name, fam in DATA_FAMILIES.items():
        if name == "largest_number" or name in families:
            demo += [fam.instruction(n, c) for n in TRAIN_NAMES for c in (3, 6, 9)]
            demo += [render_tool_call(c) for c in fam.solution]
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
    # Architecture and MoE shapes (Qwen3 vs Qwen 3.5; expert count, top-k, expert and shared widths).
    "family",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    # Not shapes, but the positions a run may use: a config planning YaRN (Qwen3 past 40,960 tokens)
    # needs a checkpoint whose config.json has that rope_scaling.
    "yarn_factor",
    "yarn_original_max_position_embeddings",
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
    preset = cfg.model.preset.lower()
    if preset not in ("", "tiny") and not preset.startswith("tiny-"):
        raise ConfigError(
            f"model.preset={cfg.model.preset!r} needs model.checkpoint (a Qwen 3.5 HF directory); "
            "without one train only creates a random tiny model (presets tiny, tiny-moe, tiny-qwen3)"
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


def _allocate(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Split ``total`` over ``weights`` by largest remainder (every family at least 1 when total allows)."""
    names = sorted(weights)
    w = sum(weights.values())
    exact = {f: total * weights[f] / w for f in names}
    out = {f: int(exact[f]) for f in names}
    for f in sorted(names, key=lambda f: (out[f] - exact[f], f))[: total - sum(out.values())]:
        out[f] += 1
    return out


def _axis_families(axes: dict) -> list[str]:
    """Generator families whose fixed axes pass the filter ``axes`` (axis -> allowed value(s))."""
    from tmax_jax.tasks.generator.registry import all_families

    def allowed(v) -> set[str]:
        return {v} if isinstance(v, str) else set(v)

    fams = all_families()
    out = [n for n, f in sorted(fams.items()) if all(getattr(f, a) in allowed(v) for a, v in axes.items())]
    if not out:
        raise ConfigError(f"tasks.axes {axes} matches no task family")
    return out


class _Writer:
    """Writes task ``seed`` of a procedural family (generator or demo) into a directory."""

    def __init__(self, cfg: TrainConfig):
        from tmax_jax.tasks.axes import AxisSampler
        from tmax_jax.tasks.generator.procedural import ProceduralGenerator
        from tmax_jax.tasks.generator.registry import all_families

        self.cfg = cfg
        self.generator_families = all_families()
        self._gen = lambda: ProceduralGenerator(AxisSampler.from_yaml(corpus_kind=cfg.tasks.corpus_kind))
        self.gen = None

    def check(self, families) -> None:
        unknown = [f for f in families if f not in DEMO_FAMILIES and f not in self.generator_families]
        if unknown:
            known = sorted((*DEMO_FAMILIES, *self.generator_families))
            raise ConfigError(f"tasks.families: unknown {unknown} (known: {', '.join(known)})")

    def __call__(self, family: str, root: Path, seed: int, *, heldout: bool) -> Path:
        if family in DEMO_FAMILIES:
            return write_demo_task(family, root, seed, heldout=heldout, words=self.cfg.tasks.words)
        if self.gen is None:
            self.gen = self._gen()
        return self.gen.generate_family(root, family, seed).path


def _copy_dir_tasks(cfg: TrainConfig, root: Path) -> None:
    """tasks.dir: copy the usable tasks into RUN_DIR/tasks/{train,heldout}; a seeded quarter held out."""
    import random
    import shutil

    for i, d in enumerate(cfg.tasks.dirs):
        tasks = []
        for p in find_tasks(d):
            try:
                task = load_task(p)
            except TaskFormatError as e:
                print(f"tmax-jax train: skipping malformed task {p}: {e}", file=sys.stderr)
                continue
            # A task that needs the internet where the run has none is never trained on.
            from tmax_jax.eval.environment import task_availability

            env = task_availability(task, network=cfg.sandbox.network, backend=cfg.sandbox.backend)
            if not env.available:
                print(f"tmax-jax train: skipping unavailable task {p}: {env.reason}", file=sys.stderr)
                continue
            tasks.append(task)
        if len(tasks) < 2:
            raise ConfigError(f"tasks.dir {d} has {len(tasks)} usable task(s); need at least 2")
        tasks.sort(key=lambda t: str(t.path))
        # Seeded by the directory's name, not its path: the same tasks split the same way wherever
        # the directory lives (a path-seeded split changed with pytest's tmp paths).
        random.Random(f"{cfg.tasks.seed}:{Path(d).name}").shuffle(tasks)
        n_held = min(cfg.tasks.num_heldout, len(tasks) // 4)
        for j, t in enumerate(tasks):
            split = "heldout" if j < n_held else "train"
            dest = root / split / (f"d{i}-{t.path.name}" if len(cfg.tasks.dirs) > 1 else t.path.name)
            shutil.copytree(t.path, dest, symlinks=True)


def write_task_split(cfg: TrainConfig, root: Path) -> dict:
    """Write the run's tasks into ``root/train`` and ``root/heldout`` (one directory per task) and
    ``root/split.json``; returns the split record. Held-out procedural tasks use seeds from
    ``base + 500_000`` on (training seeds from ``base``), or families only held out."""
    ts = cfg.tasks
    weights = ts.family_weights()
    for f in _axis_families(ts.axes) if ts.axes else ():
        weights.setdefault(f, 1.0)
    if ts.dirs and not ts.mix:
        weights = {}
    elif not weights and not ts.dirs:
        weights = {"write_word": 1.0}
    if ts.words < 1 or ts.words > len(WORDS):
        raise ConfigError(f"tasks.words must be in [1, {len(WORDS)}], got {ts.words}")
    held_only = list(ts.heldout_families) if weights else []
    writer = _Writer(cfg)
    writer.check([*weights, *held_only])
    overlap = sorted(set(held_only) & set(weights))
    if overlap:
        raise ConfigError(f"tasks.heldout_families {overlap} are also training families")
    tmp = root.with_name(root.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    (tmp / "train").mkdir(parents=True)
    (tmp / "heldout").mkdir(parents=True)
    base = ts.seed * 1_000_000
    record: dict = {"train": {}, "heldout": {}, "dropped_heldout": []}
    if weights:
        for f, n in _allocate(ts.num_train, weights).items():
            for i in range(n):
                p = writer(f, tmp / "train", base + i, heldout=False)
                record["train"][p.name] = f
        held_weights = {f: 1.0 for f in held_only} or weights
        for f, n in _allocate(ts.num_heldout, held_weights).items():
            for i in range(n):
                p = writer(f, tmp / "heldout", base + 500_000 + i, heldout=True)
                record["heldout"][p.name] = f
    if ts.dirs:
        _copy_dir_tasks(cfg, tmp)
        for split in ("train", "heldout"):
            for p in (tmp / split).iterdir():
                record[split].setdefault(p.name, "dir")
    # Disjoint by construction: a held-out task that asks exactly what a training task asks goes.
    seen = {_instruction(p) for p in (tmp / "train").iterdir()}
    for p in sorted((tmp / "heldout").iterdir()):
        if _instruction(p) in seen:
            import shutil

            shutil.rmtree(p)
            record["heldout"].pop(p.name)
            record["dropped_heldout"].append(p.name)
    if not record["heldout"] or len(record["train"]) < 1:
        raise ConfigError(
            f"tasks: {len(record['train'])} train and {len(record['heldout'])} held-out tasks; need at least 1 each"
        )
    (tmp / "split.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.rename(root)
    return record


def _instruction(task_dir: Path) -> str:
    p = task_dir / "instruction.md"
    if p.is_file():
        return p.read_text().strip()
    j = task_dir / "task.json"
    if j.is_file():
        data = json.loads(j.read_text())
        return str(data.get("prompt") or data.get("instruction") or data.get("description") or "").strip()
    return ""


def load_task_sets(cfg: TrainConfig, run_dir: Path) -> tuple[list[Task], list[Task]]:
    """(train, held-out) tasks, written once into RUN_DIR/tasks/{train,heldout} (see
    ``write_task_split``); a resumed run reads them back."""
    root = run_dir / "tasks"
    if not (root / "split.json").is_file():
        if root.exists():  # written by an older version (no split.json): keep its tasks
            if not (root / "train").is_dir() or not (root / "heldout").is_dir():
                raise ConfigError(f"{root} exists but holds no train/heldout split; remove it")
        else:
            write_task_split(cfg, root)
    train = [load_task(p) for p in sorted((root / "train").iterdir())]
    held = [load_task(p) for p in sorted((root / "heldout").iterdir())]
    return train, held
