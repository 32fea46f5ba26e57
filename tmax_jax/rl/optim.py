"""optax AdamW from an OptimizerConfig: lr schedule, global-norm clipping, decoupled weight decay."""

from __future__ import annotations

import optax

from tmax_jax.rl.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Linear warmup from 0 (when ``warmup_steps`` > 0), then constant / linear / cosine decay."""
    peak = cfg.learning_rate
    end = peak * cfg.end_lr_ratio
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(peak, end, cfg.decay_steps)
    else:
        after = optax.cosine_decay_schedule(peak, cfg.decay_steps, alpha=cfg.end_lr_ratio)
    if cfg.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig, *, decay_mask=None) -> optax.GradientTransformation:
    """AdamW with ``cfg``'s schedule; gradients are clipped by global norm before the moments.

    ``decay_mask``: optax mask (pytree of bools or a callable on params) choosing decayed leaves;
    None decays every parameter (TMAX trains with weight_decay 0, so the choice rarely matters).
    """
    parts = []
    if cfg.grad_clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
    parts.append(
        optax.adamw(
            learning_rate_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    )
    return optax.chain(*parts)
