"""RL and optimizer configs (frozen dataclasses; YAML files only override fields)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tmax_jax.errors import ConfigError

LossName = Literal["dppo", "ppo_clip", "grpo", "cispo", "sft"]
Divergence = Literal["tv", "kl"]
AdvantageMode = Literal["centered", "std"]
Schedule = Literal["constant", "linear", "cosine"]


def _positive(name: str, v) -> None:
    if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
        raise ConfigError(f"loss.{name} must be a number > 0 or null, got {v!r}")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which objective the train step optimises, and the off-policy corrections around it.

    ``dppo`` is the TMAX default (divergence-masked ratio, delta 0.1 on binary TV, no corrections).
    ``ppo_clip``, ``grpo`` and ``cispo`` exist so the paper's stability comparison can be re-run
    with the same trainer; ``sft`` is the token NLL of the SFT warm start. Every correction is off
    by default.
    """

    name: LossName = "dppo"
    delta: float = 0.1  # dppo: divergence threshold (for A < 0, and for A > 0 unless delta_high is set)
    delta_high: float | None = None  # dppo: threshold for A > 0 tokens (r > 1); None: same as delta
    divergence: Divergence = "tv"
    clip_eps: float = 0.2  # ppo_clip / grpo: ratio clipped to [1 - eps_low, 1 + eps_high]
    clip_eps_high: float | None = None  # None: same as clip_eps (DAPO clip-higher; cispo's IS cap 1 + it)
    temperature: float = 1.0  # logprobs are log_softmax(logits / temperature), as in the rollout engine
    logprob_chunk: int = 1024  # sequence chunk for the float32 LM head (bounds the [B, chunk, V] buffer)
    # Off-policy corrections (each off by default).
    tis_cap: float | None = None  # token-level truncated IS: the gradient weight pi/mu capped at this
    seq_mask_low: float | None = None  # drop a sequence whose geometric-mean pi/mu is below this ...
    seq_mask_high: float | None = None  # ... or above this (IcePop / MIS-style masking)
    # The trainer's pi over the truncated (top-k / nucleus) support the engine sampled from; set to
    # the sampling top_k / top_p, with an engine that reports truncated logprobs too. 0 / 1: off.
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        from tmax_jax.rl.losses import LOSSES  # registered there; imported late (losses imports us)

        if self.name not in LOSSES:
            raise ConfigError(f"loss.name must be one of {tuple(LOSSES)}, got {self.name!r}")
        if self.divergence not in ("tv", "kl"):
            raise ConfigError(f"loss.divergence must be 'tv' or 'kl', got {self.divergence!r}")
        if self.delta < 0 or (self.delta_high is not None and self.delta_high < 0):
            raise ConfigError(f"loss.delta must be >= 0, got {self.delta} / delta_high {self.delta_high}")
        if self.clip_eps <= 0 or (self.clip_eps_high is not None and self.clip_eps_high <= 0):
            raise ConfigError(f"loss.clip_eps must be > 0, got {self.clip_eps} / {self.clip_eps_high}")
        if self.temperature <= 0:
            raise ConfigError(f"loss.temperature must be > 0, got {self.temperature}")
        if self.logprob_chunk <= 0:
            raise ConfigError(f"loss.logprob_chunk must be > 0, got {self.logprob_chunk}")
        for f in ("tis_cap", "seq_mask_low", "seq_mask_high"):
            _positive(f, getattr(self, f))
        if self.tis_cap is not None:
            if self.tis_cap < 1:
                raise ConfigError(
                    f"loss.tis_cap must be >= 1 (on-policy tokens have ratio 1), got {self.tis_cap}"
                )
            if not LOSSES[self.name].importance_weighted:
                raise ConfigError(
                    f"loss.tis_cap does not apply to loss {self.name!r}: its gradient is not weighted by pi/mu"
                )
        if self.seq_mask_low is not None and self.seq_mask_low > 1:
            raise ConfigError(
                f"loss.seq_mask_low must be <= 1 (on-policy sequences have ratio 1), got {self.seq_mask_low}"
            )
        if self.seq_mask_high is not None and self.seq_mask_high < 1:
            raise ConfigError(
                f"loss.seq_mask_high must be >= 1 (on-policy sequences have ratio 1), got {self.seq_mask_high}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"loss.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"loss.top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def truncated(self) -> bool:
        """The logprobs are those of the truncated (top-k / top-p) distribution."""
        return self.top_k > 0 or self.top_p < 1.0


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
    # The model's checkpointing (Qwen35ForCausalLM remat): "full" keeps the least; "layers" skips the
    # period-level recompute (a fifth less work per step) and keeps every layer's two inputs.
    remat: Literal["none", "full", "layers", "dots"] = "full"
    # MoE models only. The load-balancing loss (transformers' load_balancing_loss_func over all MoE
    # layers) times this is added to the loss: 0 = off, the RL default (e.g. 0.001, the published
    # checkpoints' router_aux_loss_coef, turns it on). Router load metrics are reported either way.
    router_aux_loss_coef: float = 0.0
    # Routing replay: every MoE layer uses the expert ids the engine chose for each token (the batch
    # field routed_experts) instead of re-routing; the gate weights are still recomputed from the
    # router, so it keeps learning. Tokens without recorded ids (-1) are routed as usual.
    routing_replay: bool = False

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ConfigError(f"train_step.micro_batches must be >= 1, got {self.micro_batches}")
        if not (isinstance(self.router_aux_loss_coef, (int, float)) and self.router_aux_loss_coef >= 0):
            raise ConfigError(
                f"train_step.router_aux_loss_coef must be a number >= 0, got {self.router_aux_loss_coef!r}"
            )


@dataclasses.dataclass(frozen=True)
class RLConfig:
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train_step: TrainStepConfig = dataclasses.field(default_factory=TrainStepConfig)
