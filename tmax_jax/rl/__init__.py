"""RL objectives and the train step: advantages, DPPO / PPO-clip / GRPO, float32 chunked logprobs."""

from tmax_jax.rl.advantages import GroupAdvantages, group_advantages
from tmax_jax.rl.config import AdvantageConfig, LossConfig, OptimizerConfig, RLConfig, TrainStepConfig
from tmax_jax.rl.logprobs import LogprobInputError, token_logprobs, token_logprobs_plain
from tmax_jax.rl.losses import LOSS_NAMES, LossInputError, dppo_loss, dppo_loss_per_token, policy_loss
from tmax_jax.rl.optim import learning_rate_schedule, make_optimizer

__all__ = [
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
    "learning_rate_schedule",
    "make_optimizer",
    "policy_loss",
    "token_logprobs",
    "token_logprobs_plain",
]
