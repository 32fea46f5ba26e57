"""Policy-gradient objectives on per-token logprobs: DPPO (TMAX default), PPO-clip and GRPO.

Every objective is split into an un-normalised per-batch sum and a normaliser, so gradient
accumulation over micro-batches divides by the *whole* batch's count (``sum(response_mask)`` for the
token-level losses, the number of sequences for GRPO) and gives the same update as one big batch.

Statistics are carried as sums (and maxima, keys starting with ``max_``) for the same reason;
``finalize_stats`` turns them into the reported fractions and means.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from tmax_jax.errors import TmaxError
from tmax_jax.rl.config import LossConfig

LOSS_NAMES = ("dppo", "ppo_clip", "grpo")
DIVERGENCES = ("tv", "kl")
# Keeps log(1 - p) finite when a float32 probability rounds to 1.
_LOG_P_CEIL = -1e-7


class LossInputError(TmaxError, ValueError):
    """Arrays handed to a loss have the wrong shape or dtype."""


def _check_2d(name: str, x, shape=None, float32: bool = False) -> None:
    if getattr(x, "ndim", None) != 2:
        raise LossInputError(f"{name} must be [B, T], got shape {getattr(x, 'shape', None)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise LossInputError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} like logprobs")
    if float32 and x.dtype != jnp.float32:
        raise LossInputError(f"{name} must be float32, got {x.dtype}")


def check_loss_inputs(logprobs, rollout_logprobs, advantages, response_mask, *, per_token: bool) -> None:
    """Raise LossInputError naming the first argument whose shape or dtype is wrong."""
    _check_2d("logprobs", logprobs, float32=True)
    shape = logprobs.shape
    _check_2d("rollout_logprobs", rollout_logprobs, shape, float32=True)
    _check_2d("response_mask", response_mask, shape)
    if not (
        jnp.issubdtype(response_mask.dtype, jnp.floating) or response_mask.dtype in (jnp.bool_, jnp.int32)
    ):
        raise LossInputError(f"response_mask must be float, bool or int32, got {response_mask.dtype}")
    if per_token:
        _check_2d("advantages", advantages, shape)
    elif getattr(advantages, "ndim", None) != 1 or advantages.shape[0] != shape[0]:
        raise LossInputError(
            f"advantages must be [B] = [{shape[0]}] (one per row), got shape {getattr(advantages, 'shape', None)}"
        )
    if not jnp.issubdtype(advantages.dtype, jnp.floating):
        raise LossInputError(f"advantages must be floating point, got {advantages.dtype}")


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, accurate on both sides of -ln 2."""
    x = jnp.minimum(x, _LOG_P_CEIL)
    return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def binary_divergence(logprobs, rollout_logprobs, divergence: str):
    """Divergence between Bernoulli(mu) and Bernoulli(pi) of the sampled token (Qi et al., Eqs. 11-14).

    ``tv``: |pi - mu|. ``kl``: mu log(mu/pi) + (1 - mu) log((1 - mu)/(1 - pi)).
    """
    lp = logprobs.astype(jnp.float32)
    lmu = rollout_logprobs.astype(jnp.float32)
    if divergence == "tv":
        return jnp.abs(jnp.exp(lp) - jnp.exp(lmu))
    if divergence == "kl":
        mu = jnp.exp(lmu)
        head = mu * (lmu - lp)
        tail = (1.0 - mu) * (_log1mexp(lmu) - _log1mexp(lp))
        return head + jnp.where(mu < 1.0, tail, 0.0)
    raise LossInputError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")


def _ratio(logprobs, rollout_logprobs):
    return jnp.exp(logprobs.astype(jnp.float32) - rollout_logprobs.astype(jnp.float32))


def _base_stats(logprobs, rollout_logprobs, ratio, mask):
    diff = jnp.abs(jax.lax.stop_gradient(logprobs) - rollout_logprobs)
    return {
        "tokens": mask.sum(),
        "ratio_sum": (jax.lax.stop_gradient(ratio) * mask).sum(),
        "max_abs_logprob_diff": jnp.max(jnp.where(mask > 0, diff, 0.0), initial=0.0),
    }


def dppo_terms(logprobs, rollout_logprobs, adv_BxT, mask_BxT, *, delta: float, divergence: str):
    """DPPO per-batch sum ``sum(-A * r * M)`` and statistics (not yet divided by the token count).

    M drops tokens whose divergence exceeds ``delta`` *and* whose update would push r further from 1;
    it is computed under stop_gradient, so the gradient flows through r only.
    """
    mask = mask_BxT.astype(jnp.float32)
    adv = adv_BxT.astype(jnp.float32)
    ratio = _ratio(logprobs, rollout_logprobs)
    div = jax.lax.stop_gradient(binary_divergence(logprobs, rollout_logprobs, divergence))
    r_sg = jax.lax.stop_gradient(ratio)
    bad_pos = (div > delta) & (adv > 0) & (r_sg > 1)
    bad_neg = (div > delta) & (adv < 0) & (r_sg < 1)
    keep = jax.lax.stop_gradient(jnp.where(bad_pos | bad_neg, 0.0, mask))
    loss_sum = jnp.sum(-adv * ratio * keep)
    stats = _base_stats(logprobs, rollout_logprobs, ratio, mask)
    stats |= {
        "masked": ((bad_pos | bad_neg) * mask).sum(),
        "masked_pos_adv": (bad_pos * mask).sum(),
        "masked_neg_adv": (bad_neg * mask).sum(),
        "divergence_sum": (div * mask).sum(),
    }
    return loss_sum, stats


def _clip_token_loss(logprobs, rollout_logprobs, adv, mask, eps_low: float, eps_high: float):
    ratio = _ratio(logprobs, rollout_logprobs)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    r_sg = jax.lax.stop_gradient(ratio)
    was_clipped = ((adv > 0) & (r_sg > 1.0 + eps_high)) | ((adv < 0) & (r_sg < 1.0 - eps_low))
    stats = _base_stats(logprobs, rollout_logprobs, ratio, mask)
    stats["masked"] = (was_clipped * mask).sum()
    stats["masked_pos_adv"] = ((was_clipped & (adv > 0)) * mask).sum()
    stats["masked_neg_adv"] = ((was_clipped & (adv < 0)) * mask).sum()
    return per_token, stats


def ppo_clip_terms(logprobs, rollout_logprobs, adv_BxT, mask_BxT, *, eps_low: float, eps_high: float):
    """Token-level PPO-clip against the rollout policy: sum(-min(r A, clip(r) A) * mask)."""
    mask = mask_BxT.astype(jnp.float32)
    per_token, stats = _clip_token_loss(
        logprobs, rollout_logprobs, adv_BxT.astype(jnp.float32), mask, eps_low, eps_high
    )
    return jnp.sum(per_token * mask), stats


def _sequence_index(segment_ids_BxT):
    """A flat id per (row, contiguous segment), always < B*T, for segment sums."""
    B, T = segment_ids_BxT.shape
    starts = jnp.concatenate(
        [jnp.ones((B, 1), bool), segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1
    )
    local = jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1
    return jnp.arange(B, dtype=jnp.int32)[:, None] * T + local


def _sequence_token_counts(mask_BxT, segment_ids_BxT):
    flat_ids = _sequence_index(segment_ids_BxT).reshape(-1)
    counts = jax.ops.segment_sum(mask_BxT.reshape(-1), flat_ids, num_segments=mask_BxT.size)
    return counts, flat_ids


def grpo_terms(logprobs, rollout_logprobs, adv_BxT, mask_BxT, segment_ids_BxT, *, eps_low, eps_high):
    """GRPO (Shao et al.): PPO-clip averaged over each sequence's tokens, then summed over sequences."""
    mask = mask_BxT.astype(jnp.float32)
    per_token, stats = _clip_token_loss(
        logprobs, rollout_logprobs, adv_BxT.astype(jnp.float32), mask, eps_low, eps_high
    )
    counts, flat_ids = _sequence_token_counts(mask, segment_ids_BxT)
    seq_len_BxT = counts[flat_ids].reshape(mask.shape)
    weight = jnp.where(mask > 0, mask / jnp.maximum(seq_len_BxT, 1.0), 0.0)
    return jnp.sum(per_token * weight), stats


def loss_normalizer(name: str, response_mask_BxT, segment_ids_BxT=None):
    """What the summed loss is divided by: response tokens (dppo, ppo_clip) or sequences (grpo)."""
    mask = response_mask_BxT.astype(jnp.float32)
    if name == "grpo":
        # Without segment ids every row is one sequence (multi-turn rows interleave masked tool output).
        seg = segment_ids_BxT if segment_ids_BxT is not None else jnp.ones(mask.shape, jnp.int32)
        counts, _ = _sequence_token_counts(mask, seg)
        return jnp.maximum((counts > 0).sum().astype(jnp.float32), 1.0)
    return jnp.maximum(mask.sum(), 1.0)


def loss_terms(name: str, cfg: LossConfig, logprobs, rollout_logprobs, adv_BxT, mask_BxT, segment_ids_BxT):
    """Dispatch on ``name`` (``cfg.name`` normally); returns (un-normalised loss sum, stat sums)."""
    eps_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    if name == "dppo":
        return dppo_terms(
            logprobs, rollout_logprobs, adv_BxT, mask_BxT, delta=cfg.delta, divergence=cfg.divergence
        )
    if name == "ppo_clip":
        return ppo_clip_terms(
            logprobs, rollout_logprobs, adv_BxT, mask_BxT, eps_low=cfg.clip_eps, eps_high=eps_high
        )
    if name == "grpo":
        return grpo_terms(
            logprobs,
            rollout_logprobs,
            adv_BxT,
            mask_BxT,
            segment_ids_BxT,
            eps_low=cfg.clip_eps,
            eps_high=eps_high,
        )
    raise LossInputError(f"loss name must be one of {LOSS_NAMES}, got {name!r}")


def combine_stats(a: Mapping, b: Mapping) -> dict:
    """Merge two micro-batches' stat sums (``max_*`` keys by maximum)."""
    return {k: jnp.maximum(a[k], b[k]) if k.startswith("max_") else a[k] + b[k] for k in a}


def finalize_stats(stats: Mapping) -> dict:
    """Turn stat sums into the reported metrics (fractions are over response tokens)."""
    tokens = jnp.maximum(stats["tokens"], 1.0)
    out = {
        "response_tokens": stats["tokens"],
        "ratio_mean": stats["ratio_sum"] / tokens,
        "max_abs_logprob_diff": stats["max_abs_logprob_diff"],
        "masked_fraction": stats["masked"] / tokens,
        "masked_fraction_pos_adv": stats["masked_pos_adv"] / tokens,
        "masked_fraction_neg_adv": stats["masked_neg_adv"] / tokens,
    }
    if "divergence_sum" in stats:
        out["divergence_mean"] = stats["divergence_sum"] / tokens
    return out


def dppo_loss(logprobs, rollout_logprobs, advantages, response_mask, *, delta=0.1, divergence="tv"):
    """DPPO loss with binary-divergence masking (TMAX's objective).

    Args:
      logprobs: float32 [B, T], the trainer's log pi of each target token (gradient flows through it).
      rollout_logprobs: float32 [B, T], the rollout engine's log mu of the same tokens.
      advantages: float32 [B], one per row (use ``dppo_loss_per_token`` for packed rows).
      response_mask: [B, T], 1 on policy-generated tokens, 0 on prompt, tool output and padding.
      delta: divergence threshold; divergence: ``"tv"`` or ``"kl"``.

    Returns ``(loss, metrics)`` with ``loss = sum(-A r M) / sum(response_mask)``.
    """
    check_loss_inputs(logprobs, rollout_logprobs, advantages, response_mask, per_token=False)
    adv_BxT = jnp.broadcast_to(advantages.astype(jnp.float32)[:, None], logprobs.shape)
    return dppo_loss_per_token(
        logprobs, rollout_logprobs, adv_BxT, response_mask, delta=delta, divergence=divergence
    )


def dppo_loss_per_token(
    logprobs, rollout_logprobs, advantages_BxT, response_mask, *, delta=0.1, divergence="tv"
):
    """``dppo_loss`` with per-token advantages [B, T] (each packed segment carries its own)."""
    check_loss_inputs(logprobs, rollout_logprobs, advantages_BxT, response_mask, per_token=True)
    if divergence not in DIVERGENCES:
        raise LossInputError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if not delta >= 0:
        raise LossInputError(f"delta must be >= 0, got {delta}")
    loss_sum, stats = dppo_terms(
        logprobs, rollout_logprobs, advantages_BxT, response_mask, delta=delta, divergence=divergence
    )
    return loss_sum / loss_normalizer("dppo", response_mask), finalize_stats(stats)


def policy_loss(cfg: LossConfig, logprobs, rollout_logprobs, advantages_BxT, response_mask, segment_ids=None):
    """Any configured objective (``cfg.name``) on per-token advantages; returns (loss, metrics)."""
    check_loss_inputs(logprobs, rollout_logprobs, advantages_BxT, response_mask, per_token=True)
    if segment_ids is None:
        segment_ids = jnp.ones(response_mask.shape, jnp.int32)
    loss_sum, stats = loss_terms(
        cfg.name, cfg, logprobs, rollout_logprobs, advantages_BxT, response_mask, segment_ids
    )
    return loss_sum / loss_normalizer(cfg.name, response_mask, segment_ids), finalize_stats(stats)
