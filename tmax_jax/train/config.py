"""The one config of a training run (``tmax-jax train CONFIG.yaml``): a frozen dataclass tree.

YAML files under ``configs/`` override fields of ``TrainConfig()``; unknown keys are errors. The same
file drives ``tmax-jax plan CONFIG.yaml`` (the ``plan`` section names the hardware it is planned for).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from tmax_jax.agent.episode import AgentConfig
from tmax_jax.config import load_yaml, override
from tmax_jax.distributed import DistributedConfig
from tmax_jax.errors import ConfigError
from tmax_jax.kernels.dispatch import KERNEL_CHOICES
from tmax_jax.rl.config import RLConfig
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sharding import MeshConfig
from tmax_jax.train.metrics import LoggingConfig

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The policy's weights and its shape.

    ``checkpoint`` is a local HF directory; "" makes train create a random tiny model in RUN_DIR/init
    (the CPU demo; a random 9B would be a 36 GB file of noise, so larger presets need a checkpoint).
    ``preset`` (a Qwen35Config preset: "9b", "27b", ...) plus ``overrides`` (Qwen35Config fields) is
    the shape ``tmax-jax plan`` plans for without reading the checkpoint; train checks that the
    checkpoint has that shape. Without a preset the plan reads the checkpoint's config.json, and with
    neither it plans the tiny model.
    """

    checkpoint: str = ""
    preset: str = ""
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    init_seed: int = 0
    dtype: str = "float32"  # compute dtype of the policy (bfloat16 on accelerators); the head is f32
    param_dtype: str = "float32"
    # Runtime choices of the model's kernels (Qwen35Config.kernels / attention_kernels: auto, jax,
    # pallas); "" keeps the model's defaults. The target platform decides what "auto" means.
    kernels: str = ""
    attention_kernels: str = ""

    def __post_init__(self) -> None:
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"model.{name}={getattr(self, name)!r}; expected one of {list(DTYPES)}")
        for name in ("kernels", "attention_kernels"):
            if getattr(self, name) not in ("", *KERNEL_CHOICES):
                raise ConfigError(
                    f"model.{name}={getattr(self, name)!r}; expected one of {list(KERNEL_CHOICES)} or ''"
                )

    def runtime_choices(self) -> dict[str, str]:
        """The kernel choices this config sets (for ``load_hf`` and ``shape``)."""
        return {k: getattr(self, k) for k in ("kernels", "attention_kernels") if getattr(self, k)}

    def shape(self):
        """The Qwen35Config this run trains: preset (or the checkpoint's config.json, or tiny) + overrides."""
        from tmax_jax.models.qwen35 import Qwen35Config

        if self.preset or not self.checkpoint:
            base = Qwen35Config.preset(self.preset or "tiny")
        else:
            from tmax_jax.checkpoints.load import read_hf_config

            base = read_hf_config(self.checkpoint)
        updates = dict(self.overrides)
        if {"num_hidden_layers", "full_attention_interval"} & set(updates) and "layer_types" not in updates:
            updates["layer_types"] = ()  # re-derive the layer pattern for the new depth / interval
        return dataclasses.replace(override(base, updates, _path="model.overrides"), **self.runtime_choices())

    @property
    def name(self) -> str:
        return self.preset or self.checkpoint or "tiny"


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """The hardware ``tmax-jax plan`` checks the run against (train itself uses the devices it sees)."""

    num_devices: int = 0  # 0 = the devices JAX sees here
    device_name: str = "device"
    device_memory_gib: float | None = None  # None = no fit verdict
    # The TPU slice `plan --compile` compiles for (libtpu's topology names, jax.experimental.topologies):
    # e.g. "v5p:2x4x4" (32 chips), "v5p:2x2x1" (one 4-chip host); "" = none (no XLA:TPU compile).
    topology: str = ""
    chip_config: str = "megacore"  # "megacore" (v4, v5p: one device per chip) or "default"
    chips_per_host: tuple[int, ...] = (2, 2, 1)
    num_slices: int = 1

    def __post_init__(self) -> None:
        if self.num_devices < 0:
            raise ConfigError(f"plan.num_devices must be >= 0, got {self.num_devices}")
        if self.chip_config not in ("megacore", "default"):
            raise ConfigError(f"plan.chip_config must be megacore or default, got {self.chip_config!r}")
        if len(self.chips_per_host) != 3 or any(int(n) < 1 for n in self.chips_per_host):
            raise ConfigError(
                f"plan.chips_per_host must be three sizes >= 1, got {list(self.chips_per_host)}"
            )
        if self.num_slices < 1:
            raise ConfigError(f"plan.num_slices must be >= 1, got {self.num_slices}")
        if self.device_memory_gib is not None and self.device_memory_gib <= 0:
            raise ConfigError(f"plan.device_memory_gib must be > 0, got {self.device_memory_gib}")


AXIS_FILTER_KEYS = (
    "domain",
    "skill_type",
    "primitive_skill",
    "fixture_kind",
    "command_complexity",
    "verifier_kind",
)


@dataclasses.dataclass(frozen=True)
class TaskSource:
    """Where the run's train and held-out tasks come from (``tmax_jax/train/setup.py: load_task_sets``).

    ``families`` names procedural families: any of the task generator's 30 (``tmax_jax/tasks/generator``)
    or a demo family (``write_word``, ``largest_number``), as a list (weight 1 each) or a mapping
    family -> weight (the share of ``num_train`` / ``num_heldout`` it gets). ``axes`` adds every
    generator family whose fixed axes match the filter (axis -> allowed values, e.g.
    ``{verifier_kind: [exact_text], domain: [security]}``), weight 1 each; ``corpus_kind`` re-weights
    the axes the families leave free (task complexity). ``dir`` is one or more Harbor/TMAX task
    directories; with ``mix: true`` the families are generated beside them (otherwise a dir replaces
    the families, so a config's demo families and a ``--set tasks.dir=...`` do not mix by surprise);
    a quarter of their tasks (at most ``num_heldout``), picked by
    ``seed``, are held out. Procedural held-out tasks use seeds no training task uses, or whole
    families (``heldout_families``: generated only for the held-out set); a held-out task whose
    instruction equals a training one is dropped. Nothing set: the ``write_word`` demo family.
    """

    dir: str | tuple[str, ...] = ""
    families: dict[str, float] | tuple[str, ...] = ()
    axes: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    corpus_kind: str = "rl_v2"
    mix: bool = False  # tasks.dir and tasks.families together
    heldout_families: tuple[str, ...] = ()
    words: int = 16  # write_word family: how many distinct words the tasks draw from (1..16)
    num_train: int = 64
    num_heldout: int = 16  # pass_rate_before/after are measured on these (seeds never trained on)
    seed: int = 0

    def __post_init__(self) -> None:
        weights = self.family_weights()
        bad = {f: w for f, w in weights.items() if not (isinstance(w, (int, float)) and w > 0)}
        if bad:
            raise ConfigError(f"tasks.families: weights must be numbers > 0, got {bad}")
        unknown = sorted(set(self.axes) - set(AXIS_FILTER_KEYS))
        if unknown:
            raise ConfigError(f"tasks.axes: unknown axis {unknown} (known: {list(AXIS_FILTER_KEYS)})")
        for name in ("num_train", "num_heldout"):
            if getattr(self, name) < 1:
                raise ConfigError(f"tasks.{name} must be >= 1, got {getattr(self, name)}")

    def family_weights(self) -> dict[str, float]:
        if isinstance(self.families, dict):
            return dict(self.families)
        return {f: 1.0 for f in self.families}

    @property
    def dirs(self) -> tuple[str, ...]:
        return (self.dir,) if isinstance(self.dir, str) and self.dir else tuple(self.dir or ())


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
    """TMAX's soft filtering and active sampling over the training prompts (``train/curriculum.py``).

    Every prompt keeps its last ``window`` group pass rates. A prompt whose last ``min_groups`` (or
    more) groups all passed, or all failed, is *saturated*: it is drawn with weight ``saturated_weight``
    instead of 1, and retired (never drawn again) once it stayed saturated for ``retire_after`` groups
    (0 = never retire); a prompt is un-retired when every prompt would be. A step keeps drawing
    prompts (``prompts_per_step`` at a time) until it has ``prompts_per_step`` groups whose rewards
    are not all equal, or it ran ``max_draws`` draws; the extra draws and what was thrown away are
    counted in the metrics (``curriculum/*``). Off: every prompt is drawn in the loader's order.
    """

    enabled: bool = False
    window: int = 4
    min_groups: int = 2
    saturated_weight: float = 0.1
    retire_after: int = 0
    max_draws: int = 3

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("min_groups", 1), ("retire_after", 0), ("max_draws", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"curriculum.{name} must be >= {low}, got {getattr(self, name)}")
        if self.min_groups > self.window:
            raise ConfigError(f"curriculum.min_groups ({self.min_groups}) must be <= window ({self.window})")
        if not 0.0 <= self.saturated_weight <= 1.0:
            raise ConfigError(f"curriculum.saturated_weight must be in [0, 1], got {self.saturated_weight}")


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """The rollout engine. ``speculative_tokens`` > 0 drafts that many tokens per decode step with
    the checkpoint's multi-token-prediction module (its ``mtp.*`` tensors; frozen while the policy
    trains unless ``draft_fit_steps`` refits it) and verifies them in one pass: the sampled tokens
    and logprobs stay the policy's own, only the number of model passes changes (README,
    "Speculative decoding")."""

    slots: int = 32  # decode slots (episodes generating at once)
    max_cache_length: int = 4096
    max_prefill_length: int = 1024
    cache_dtype: str = "float32"
    speculative_tokens: int = 0
    # After every RL step, this many AdamW steps fit the MTP module to the updated policy on that
    # step's rollouts (train/mtp_fit.py's distillation), so the draft follows the policy (0: frozen).
    draft_fit_steps: int = 0
    draft_fit_learning_rate: float = 1e-3
    draft_fit_batch_size: int = 8

    def __post_init__(self) -> None:
        for name, low in (("speculative_tokens", 0), ("draft_fit_steps", 0), ("draft_fit_batch_size", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"engine.{name} must be an integer >= {low}, got {v!r}")
        if not self.draft_fit_learning_rate > 0:
            raise ConfigError(
                f"engine.draft_fit_learning_rate must be > 0, got {self.draft_fit_learning_rate!r}"
            )
        if self.draft_fit_steps and not self.speculative_tokens:
            raise ConfigError(
                "engine.draft_fit_steps fits the draft of speculative decoding: set engine.speculative_tokens"
            )


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Warm start on demonstrations (reference solutions replayed through the harness)."""

    steps: int = 0  # 0 = no warm start
    batch_size: int = 16
    learning_rate: float = 1e-3
    seq_len: int = 2048
    demos_per_task: int = 1

    def __post_init__(self) -> None:
        for name, low in (("steps", 0), ("batch_size", 1), ("seq_len", 2), ("demos_per_task", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"sft.{name} must be >= {low}, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ConfigError(f"sft.learning_rate must be > 0, got {self.learning_rate}")


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    samples_per_task: int = 4  # held-out pass rate = mean reward over tasks x samples
    every: int = 0  # also evaluate every N steps (0 = only before and after)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    steps: int = 100
    prompts_per_step: int = 8
    group_size: int = 32
    async_steps: int = 4  # rollouts may run this many steps ahead; staler groups are dropped
    mode: Literal["async", "sync"] = "async"
    rollout_workers: int = 32  # episodes in flight (threads driving sandboxes and the engine)
    temperature: float = 1.0
    top_p: float = 1.0  # rollout sampling truncation (0 / 1: off); the loss must use the same
    top_k: int = 0
    seq_len: int = 8192  # train row length (trajectories are packed into rows)
    save_every: int = 10
    keep_checkpoints: int = 3
    save_trajectories: bool = True
    model: ModelSource = dataclasses.field(default_factory=ModelSource)
    tasks: TaskSource = dataclasses.field(default_factory=TaskSource)
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    engine: EngineSettings = dataclasses.field(default_factory=EngineSettings)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    eval: EvalSettings = dataclasses.field(default_factory=EvalSettings)
    curriculum: CurriculumConfig = dataclasses.field(default_factory=CurriculumConfig)
    # An episode that ends without the submit marker (turn limit, format errors, context) scores 0
    # whatever the files say: the episode ends where the recipe ends it, and nothing the policy
    # says after solving the task but before submitting can share a passing episode's advantage.
    reward_requires_submit: bool = False
    plan: PlanSettings = dataclasses.field(default_factory=PlanSettings)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "rollout_workers", "seq_len", "save_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.async_steps < 0:
            raise ConfigError(f"async_steps must be >= 0, got {self.async_steps}")
        if self.group_size < 2:
            raise ConfigError("group_size must be >= 2: advantages are relative to the group")
        if self.rl.loss.temperature != self.temperature:
            # The engine's logprobs are log_softmax(logits / temperature); a loss at another
            # temperature would see every token as off-policy (ratio != 1 at staleness 0).
            raise ConfigError(
                f"rl.loss.temperature ({self.rl.loss.temperature}) must equal the sampling temperature "
                f"({self.temperature})"
            )
        loss = self.rl.loss
        if (loss.top_k, loss.top_p) != (self.top_k, self.top_p):
            # The engine reports logprobs of the truncated distribution it samples from; a trainer
            # over another support would compare two different distributions (ratio != 1 on policy).
            raise ConfigError(
                f"rl.loss.top_k / rl.loss.top_p ({loss.top_k} / {loss.top_p}) must equal the rollout "
                f"sampling top_k / top_p ({self.top_k} / {self.top_p})"
            )

    @property
    def harness(self) -> str:
        """The agent harness of every episode (``agent.harness``: bash, mini-swe, openhands, terminus).

        It is part of the run's identity: config.yaml records it and a resume under another harness
        is refused.
        """
        return self.agent.harness

    @property
    def max_staleness(self) -> int:
        return 0 if self.mode == "sync" else self.async_steps

    @property
    def rows_per_step(self) -> int:
        # Worst case of what _train_on packs: every trajectory of the step, none soft-filtered, each
        # filling a whole seq_len row (TMAX: 8 x 32 = 256 rows x 65536). The trainer pads the row
        # count to a power of two and a multiple of data * fsdp * micro_batches; 256 already is.
        return self.prompts_per_step * self.group_size


def load_train_config(path: str | Path | None, overrides: dict | None = None) -> TrainConfig:
    cfg = TrainConfig()
    if path:
        cfg = override(cfg, load_yaml(path))
    if overrides:
        cfg = override(cfg, overrides)
    return cfg
