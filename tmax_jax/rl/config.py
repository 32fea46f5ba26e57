"""RL and optimizer configs (frozen dataclasses; YAML files only override fields)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tmax_jax.errors import ConfigError

LossName = Literal["dppo", "ppo_clip", "grpo"]
Divergence = Literal["tv", "kl"]
AdvantageMode = Literal["centered", "std"]
Schedule = Literal["constant", "linear", "cosine"]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which policy-gradient objective the train step optimises.

    ``dppo`` is the TMAX default (divergence-masked ratio, delta 0.1 on binary TV). ``ppo_clip`` and
    ``grpo`` exist so the paper's stability comparison can be re-run with the same trainer.
    """

    name: LossName = "dppo"
    delta: float = 0.1
    divergence: Divergence = "tv"
    clip_eps: float = 0.2  # ppo_clip / grpo: ratio clipped to [1 - eps_low, 1 + eps_high]
    clip_eps_high: float | None = None  # None: same as clip_eps (set higher for DAPO-style clip-higher)
    temperature: float = 1.0  # logprobs are log_softmax(logits / temperature), as in the rollout engine
    logprob_chunk: int = 1024  # sequence chunk for the float32 LM head (bounds the [B, chunk, V] buffer)

    def __post_init__(self) -> None:
        if self.delta < 0:
            raise ConfigError(f"loss.delta must be >= 0, got {self.delta}")
        if self.clip_eps <= 0 or (self.clip_eps_high is not None and self.clip_eps_high <= 0):
            raise ConfigError(f"loss.clip_eps must be > 0, got {self.clip_eps} / {self.clip_eps_high}")
        if self.temperature <= 0:
            raise ConfigError(f"loss.temperature must be > 0, got {self.temperature}")
        if self.logprob_chunk <= 0:
            raise ConfigError(f"loss.logprob_chunk must be > 0, got {self.logprob_chunk}")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    mode: AdvantageMode = "centered"  # TMAX: R - mean_group(R), no std division
    std_eps: float = 1e-6
    drop_constant_groups: bool = True  # soft filtering: equal rewards carry no signal


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with an lr schedule and global-norm gradient clipping (TMAX-9B: lr 1e-6 constant)."""

    learning_rate: float = 1e-6
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0  # linear/cosine: steps after warmup to reach end_lr_ratio * learning_rate
    end_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float | None = 1.0  # None disables clipping

    def __post_init__(self) -> None:
        if self.learning_rate < 0:
            raise ConfigError(f"optimizer.learning_rate must be >= 0, got {self.learning_rate}")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ConfigError("optimizer.warmup_steps and optimizer.decay_steps must be >= 0")
        if self.schedule != "constant" and self.decay_steps == 0:
            raise ConfigError(f"optimizer.schedule={self.schedule!r} needs optimizer.decay_steps > 0")
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0:
            raise ConfigError(f"optimizer.grad_clip_norm must be > 0 or null, got {self.grad_clip_norm}")


@dataclasses.dataclass(frozen=True)
class TrainStepConfig:
    """How one optimizer step consumes its batch."""

    micro_batches: int = 1  # gradient accumulation: the batch's rows are split into this many slices
    remat: Literal["none", "full", "dots"] = "full"  # per-layer jax.checkpoint policy of the model

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ConfigError(f"train_step.micro_batches must be >= 1, got {self.micro_batches}")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train_step: TrainStepConfig = dataclasses.field(default_factory=TrainStepConfig)
