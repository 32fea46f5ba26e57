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
from tmax_jax.rl.config import RLConfig
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sharding import MeshConfig

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

    def __post_init__(self) -> None:
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"model.{name}={getattr(self, name)!r}; expected one of {list(DTYPES)}")

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
        return override(base, updates, _path="model.overrides")

    @property
    def name(self) -> str:
        return self.preset or self.checkpoint or "tiny"


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """The hardware ``tmax-jax plan`` checks the run against (train itself uses the devices it sees)."""

    num_devices: int = 0  # 0 = the devices JAX sees here
    device_name: str = "device"
    device_memory_gib: float | None = None  # None = no fit verdict

    def __post_init__(self) -> None:
        if self.num_devices < 0:
            raise ConfigError(f"plan.num_devices must be >= 0, got {self.num_devices}")
        if self.device_memory_gib is not None and self.device_memory_gib <= 0:
            raise ConfigError(f"plan.device_memory_gib must be > 0, got {self.device_memory_gib}")


@dataclasses.dataclass(frozen=True)
class TaskSource:
    dir: str = ""  # Harbor/TMAX task directory; "" = generate procedural tasks into RUN_DIR/tasks
    families: tuple[str, ...] = ()  # procedural families (empty = all)
    words: int = 16  # write_word family: how many distinct words the tasks draw from (2..16)
    num_train: int = 64
    num_heldout: int = 16  # pass_rate_before/after are measured on these (seeds never trained on)
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    slots: int = 32  # decode slots (episodes generating at once)
    max_cache_length: int = 4096
    max_prefill_length: int = 1024
    cache_dtype: str = "float32"


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
    top_p: float = 1.0
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
    plan: PlanSettings = dataclasses.field(default_factory=PlanSettings)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

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
