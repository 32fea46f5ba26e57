"""RL objectives and the train step: advantages, the loss registry (DPPO / PPO-clip / GRPO / CISPO /
SFT) with off-policy corrections, and the float32 policy head."""

from tmax_jax.rl.advantages import GroupAdvantages, group_advantages
from tmax_jax.rl.config import AdvantageConfig, LossConfig, OptimizerConfig, RLConfig, TrainStepConfig
from tmax_jax.rl.logprobs import (
    LogprobInputError,
    head_logits,
    logprobs_from_logits,
    token_logprobs,
    token_logprobs_plain,
)
from tmax_jax.rl.losses import (
    LOSS_NAMES,
    LOSSES,
    LossInputError,
    dppo_loss,
    dppo_loss_per_token,
    policy_loss,
    register_loss,
)
from tmax_jax.rl.optim import learning_rate_schedule, make_optimizer

__all__ = [
    "LOSSES",
    "LOSS_NAMES",
    "AdvantageConfig",
    "GroupAdvantages",
    "LogprobInputError",
    "LossConfig",
    "LossInputError",
    "OptimizerConfig",
    "RLConfig",
    "TrainStepConfig",
    "dppo_loss",
    "dppo_loss_per_token",
    "group_advantages",
    "head_logits",
    "logprobs_from_logits",
    "learning_rate_schedule",
    "make_optimizer",
    "policy_loss",
    "register_loss",
    "token_logprobs",
    "token_logprobs_plain",
]
