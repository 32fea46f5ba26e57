"""Policy objectives as plug-ins: DPPO (TMAX default), PPO-clip, GRPO, CISPO and SFT's token NLL.

Every loss is registered under its name with one signature,

    per_token_loss_BxT, stat_sums = loss.terms(cfg, logprobs, rollout_logprobs, adv_BxT, mask_BxT, segment_ids)

returning the *un-normalised* per-token contributions (zero off the mask) and statistics as sums, plus
a ``normalizer(mask, segment_ids)``: the response-token count for the token-level losses, the
number of sequences for GRPO. Gradient accumulation divides the micro-batch sums by the *whole*
batch's normaliser, so it gives the same update as one big batch.

``loss_terms`` wraps any registered loss with what is not the loss's business: the off-policy
corrections of ``LossConfig`` (sequence-level masking of trajectories whose geometric-mean ratio
leaves [lo, hi], token-level truncated importance sampling) and the statistics every run reports
(ratio, engine/trainer mismatch on same-version tokens, staleness). Statistics are sums (keys
starting with ``max_`` are maxima) so micro-batches combine; ``finalize_stats`` turns them into
the reported fractions and means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from tmax_jax.errors import TmaxError
from tmax_jax.rl.config import LossConfig

# Keeps log(1 - p) finite when a float32 probability rounds to 1.
_LOG_P_CEIL = -1e-7
# Policy-version lag buckets reported by the staleness histogram (the last one is "this or more").
LAG_BUCKETS = 4


class LossInputError(TmaxError, ValueError):
    """Arrays handed to a loss have the wrong shape or dtype, or the loss name is unknown."""


# -- inputs -----------------------------------------------------------------------------------------
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


# -- pieces -----------------------------------------------------------------------------------------
def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, accurate on both sides of -ln 2."""
    x = jnp.minimum(x, _LOG_P_CEIL)
    return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _binary_tv(lp, lmu):
    return jnp.abs(jnp.exp(lp) - jnp.exp(lmu))


def _binary_kl(lp, lmu):
    mu = jnp.exp(lmu)
    head = mu * (lmu - lp)
    tail = (1.0 - mu) * (_log1mexp(lmu) - _log1mexp(lp))
    return head + jnp.where(mu < 1.0, tail, 0.0)


# Divergence between Bernoulli(mu) and Bernoulli(pi) of the sampled token (Qi et al., Eqs. 11-14):
# tv = |pi - mu|; kl = mu log(mu/pi) + (1 - mu) log((1 - mu)/(1 - pi)).
DIVERGENCES: dict[str, Callable] = {"tv": _binary_tv, "kl": _binary_kl}


def binary_divergence(logprobs, rollout_logprobs, divergence: str):
    """The binary divergence ``divergence`` ("tv" or "kl") of each token, float32."""
    if divergence not in DIVERGENCES:
        raise LossInputError(f"divergence must be one of {tuple(DIVERGENCES)}, got {divergence!r}")
    return DIVERGENCES[divergence](logprobs.astype(jnp.float32), rollout_logprobs.astype(jnp.float32))


def _ratio(logprobs, rollout_logprobs):
    return jnp.exp(logprobs.astype(jnp.float32) - rollout_logprobs.astype(jnp.float32))


def _sequence_index(segment_ids_BxT):
    """A flat id per (row, contiguous segment), always < B*T, for segment sums."""
    B, T = segment_ids_BxT.shape
    starts = jnp.concatenate(
        [jnp.ones((B, 1), bool), segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1
    )
    local = jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1
    return jnp.arange(B, dtype=jnp.int32)[:, None] * T + local


def _per_sequence(values_BxT, segment_ids_BxT):
    """Segment sums of ``values`` and the flat segment id of each position."""
    flat_ids = _sequence_index(segment_ids_BxT).reshape(-1)
    sums = jax.ops.segment_sum(values_BxT.reshape(-1), flat_ids, num_segments=values_BxT.size)
    return sums, flat_ids


def token_count(mask_BxT, segment_ids_BxT):
    return jnp.maximum(mask_BxT.astype(jnp.float32).sum(), 1.0)


def sequence_count(mask_BxT, segment_ids_BxT):
    counts, _ = _per_sequence(mask_BxT.astype(jnp.float32), segment_ids_BxT)
    return jnp.maximum((counts > 0).sum().astype(jnp.float32), 1.0)


# -- the registry -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A registered objective.

    ``terms(cfg, lp, lmu, adv, mask, seg) -> (per-token loss [B, T], stat sums)``; ``normalizer(mask,
    seg)`` divides the summed loss. ``importance_weighted``: the gradient is proportional to the
    ratio pi/mu (token-level TIS then caps that weight); CISPO caps it itself and SFT has none.
    """

    name: str
    terms: Callable
    normalizer: Callable = token_count
    importance_weighted: bool = True


LOSSES: dict[str, PolicyLoss] = {}


def register_loss(name: str, *, normalizer: Callable = token_count, importance_weighted: bool = True):
    """Decorator: register ``terms`` as the loss ``name`` (LossConfig.name selects it)."""

    def wrap(terms):
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = PolicyLoss(name, terms, normalizer, importance_weighted)
        return terms

    return wrap


def get_loss(name: str) -> PolicyLoss:
    if name not in LOSSES:
        raise LossInputError(f"loss name must be one of {tuple(LOSSES)}, got {name!r}")
    return LOSSES[name]


def _eps_high(cfg: LossConfig) -> float:
    return cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high


@register_loss("dppo")
def dppo_terms(cfg: LossConfig, logprobs, rollout_logprobs, adv, mask, segment_ids):
    """DPPO: ``-A r M`` per token, M dropping tokens whose binary divergence exceeds the threshold
    *and* whose update would push r further from 1: ``delta_high`` for A > 0 with r > 1, ``delta``
    for A < 0 with r < 1. M is computed under stop_gradient, so the gradient flows through r only."""
    delta_high = cfg.delta if cfg.delta_high is None else cfg.delta_high
    ratio = _ratio(logprobs, rollout_logprobs)
    div = jax.lax.stop_gradient(binary_divergence(logprobs, rollout_logprobs, cfg.divergence))
    r_sg = jax.lax.stop_gradient(ratio)
    bad_pos = (div > delta_high) & (adv > 0) & (r_sg > 1)
    bad_neg = (div > cfg.delta) & (adv < 0) & (r_sg < 1)
    keep = jnp.where(bad_pos | bad_neg, 0.0, mask)
    stats = {
        "masked": ((bad_pos | bad_neg) * mask).sum(),
        "masked_pos_adv": (bad_pos * mask).sum(),
        "masked_neg_adv": (bad_neg * mask).sum(),
        "divergence_sum": (div * mask).sum(),
    }
    return -adv * ratio * keep, stats


def _clip_token_loss(cfg: LossConfig, logprobs, rollout_logprobs, adv, mask):
    eps_low, eps_high = cfg.clip_eps, _eps_high(cfg)
    ratio = _ratio(logprobs, rollout_logprobs)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    r_sg = jax.lax.stop_gradient(ratio)
    was_clipped = ((adv > 0) & (r_sg > 1.0 + eps_high)) | ((adv < 0) & (r_sg < 1.0 - eps_low))
    stats = {
        "masked": (was_clipped * mask).sum(),
        "masked_pos_adv": ((was_clipped & (adv > 0)) * mask).sum(),
        "masked_neg_adv": ((was_clipped & (adv < 0)) * mask).sum(),
    }
    return per_token * mask, stats


@register_loss("ppo_clip")
def ppo_clip_terms(cfg: LossConfig, logprobs, rollout_logprobs, adv, mask, segment_ids):
    """Token-level PPO-clip against the rollout policy: ``-min(r A, clip(r, 1-eps, 1+eps_high) A)``."""
    return _clip_token_loss(cfg, logprobs, rollout_logprobs, adv, mask)


@register_loss("grpo", normalizer=sequence_count)
def grpo_terms(cfg: LossConfig, logprobs, rollout_logprobs, adv, mask, segment_ids):
    """GRPO (Shao et al.): PPO-clip averaged over each sequence's tokens, then summed over sequences."""
    per_token, stats = _clip_token_loss(cfg, logprobs, rollout_logprobs, adv, mask)
    counts, flat_ids = _per_sequence(mask, segment_ids)
    seq_len_BxT = counts[flat_ids].reshape(mask.shape)
    return per_token / jnp.maximum(seq_len_BxT, 1.0), stats


@register_loss("cispo", importance_weighted=False)
def cispo_terms(cfg: LossConfig, logprobs, rollout_logprobs, adv, mask, segment_ids):
    """CISPO (MiniMax-M1): ``-sg(min(r, 1 + eps_high)) A log pi``; the IS weight is truncated
    instead of the token being dropped, so every token keeps a gradient. No lower bound on the
    weight, as in the paper's runs."""
    cap = 1.0 + _eps_high(cfg)
    r_sg = jax.lax.stop_gradient(_ratio(logprobs, rollout_logprobs))
    weight = jnp.minimum(r_sg, cap)
    capped = r_sg > cap  # tokens whose weight was truncated
    stats = {
        "masked": (capped * mask).sum(),
        "masked_pos_adv": ((capped & (adv > 0)) * mask).sum(),
        "masked_neg_adv": ((capped & (adv < 0)) * mask).sum(),
    }
    return -weight * adv * logprobs * mask, stats


@register_loss("sft", importance_weighted=False)
def sft_terms(cfg: LossConfig, logprobs, rollout_logprobs, adv, mask, segment_ids):
    """Token NLL ``-log pi`` on the masked tokens (advantages and rollout logprobs are ignored)."""
    return -logprobs * mask, {"token_prob_sum": (jnp.exp(jax.lax.stop_gradient(logprobs)) * mask).sum()}


# -- corrections and shared statistics --------------------------------------------------------------
def sequence_keep(cfg: LossConfig, logprobs, rollout_logprobs, mask, segment_ids):
    """1 on tokens of sequences whose geometric-mean ratio ``exp(mean(log pi - log mu))`` lies in
    ``[seq_mask_low, seq_mask_high]`` (IcePop / MIS-style), 0 on the others; all ones when off."""
    if cfg.seq_mask_low is None and cfg.seq_mask_high is None:
        return jnp.ones_like(mask)
    log_r = jax.lax.stop_gradient(logprobs) - rollout_logprobs
    sums, flat_ids = _per_sequence(log_r * mask, segment_ids)
    counts, _ = _per_sequence(mask, segment_ids)
    geo_BxT = jnp.exp(sums / jnp.maximum(counts, 1.0))[flat_ids].reshape(mask.shape)
    lo = 0.0 if cfg.seq_mask_low is None else cfg.seq_mask_low
    hi = jnp.inf if cfg.seq_mask_high is None else cfg.seq_mask_high
    return ((geo_BxT >= lo) & (geo_BxT <= hi)).astype(jnp.float32)


def tis_weight(cfg: LossConfig, ratio_sg):
    """Token-level truncated importance sampling: ``min(r, C) / r`` (the gradient weight r becomes
    ``min(r, C)``); ones when ``tis_cap`` is off."""
    if cfg.tis_cap is None:
        return jnp.ones_like(ratio_sg)
    return jnp.where(ratio_sg > cfg.tis_cap, cfg.tis_cap / jnp.maximum(ratio_sg, cfg.tis_cap), 1.0)


def _shared_stats(logprobs, rollout_logprobs, mask, policy_lag):
    lp = jax.lax.stop_gradient(logprobs)
    diff = jnp.abs(lp - rollout_logprobs)
    stats = {
        "tokens": mask.sum(),
        "ratio_sum": (jnp.exp(lp - rollout_logprobs) * mask).sum(),
        "max_abs_logprob_diff": jnp.max(jnp.where(mask > 0, diff, 0.0), initial=0.0),
    }
    if policy_lag is None:
        return stats
    # Mismatch: tokens sampled by the very weights the learner holds, over a context they computed
    # (lag 0: no older policy sampled this token or one before it), so any difference is numerics
    # (engine vs trainer), not staleness. KL(mu || pi) by the k3 estimator on mu's
    # samples: (r - 1) - log r >= 0 with r = pi / mu.
    same = mask * (policy_lag == 0)
    log_r = lp - rollout_logprobs
    stats |= {
        "mm_tokens": same.sum(),
        "mm_abs_diff_sum": (diff * same).sum(),
        "max_mm_abs_diff": jnp.max(jnp.where(same > 0, diff, 0.0), initial=0.0),
        "mm_kl_sum": ((jnp.expm1(log_r) - log_r) * same).sum(),
        "lag_known_tokens": (mask * (policy_lag >= 0)).sum(),
        "off_policy_tokens": (mask * (policy_lag > 0)).sum(),
    }
    for b in range(LAG_BUCKETS):
        in_b = (policy_lag >= b) if b == LAG_BUCKETS - 1 else (policy_lag == b)
        stats[f"lag_{b}_tokens"] = (mask * in_b).sum()
    return stats


def loss_terms(
    cfg: LossConfig, logprobs, rollout_logprobs, adv_BxT, mask_BxT, segment_ids_BxT, policy_lag=None
):
    """The configured loss with its corrections: (un-normalised loss sum, stat sums).

    ``policy_lag`` (int [B, T], learner version minus the version that sampled the target, < 0 where
    unknown) adds the mismatch and staleness statistics.
    """
    loss = get_loss(cfg.name)
    mask = mask_BxT.astype(jnp.float32)
    adv = adv_BxT.astype(jnp.float32)
    lmu = rollout_logprobs.astype(jnp.float32)
    stats = _shared_stats(logprobs, lmu, mask, policy_lag)
    keep_seq = jax.lax.stop_gradient(sequence_keep(cfg, logprobs, lmu, mask, segment_ids_BxT))
    used = mask * keep_seq
    per_token, loss_stats = loss.terms(cfg, logprobs, lmu, adv, used, segment_ids_BxT)
    if loss.importance_weighted and cfg.tis_cap is not None:
        r_sg = jax.lax.stop_gradient(_ratio(logprobs, lmu))
        per_token = per_token * tis_weight(cfg, r_sg)
        stats["tis_capped"] = ((r_sg > cfg.tis_cap) * used).sum()
    if cfg.seq_mask_low is not None or cfg.seq_mask_high is not None:
        stats["seq_masked"] = (mask * (1.0 - keep_seq)).sum()
    return jnp.sum(per_token), stats | loss_stats


def loss_normalizer(cfg_or_name, response_mask_BxT, segment_ids_BxT=None):
    """What the summed loss is divided by (the registered loss's normaliser over the whole batch)."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.name
    # Without segment ids every row is one sequence (multi-turn rows interleave masked tool output).
    seg = segment_ids_BxT if segment_ids_BxT is not None else jnp.ones(response_mask_BxT.shape, jnp.int32)
    return get_loss(name).normalizer(response_mask_BxT, seg)


def combine_stats(a: Mapping, b: Mapping) -> dict:
    """Merge two micro-batches' stat sums (``max_*`` keys by maximum)."""
    return {k: jnp.maximum(a[k], b[k]) if k.startswith("max_") else a[k] + b[k] for k in a}


# stat sum -> reported name, as a fraction of (or mean over) the response tokens.
_PER_TOKEN = {
    "ratio_sum": "ratio_mean",
    "masked": "masked_fraction",
    "masked_pos_adv": "masked_fraction_pos_adv",
    "masked_neg_adv": "masked_fraction_neg_adv",
    "divergence_sum": "divergence_mean",
    "token_prob_sum": "token_prob_mean",
    "tis_capped": "tis_capped_fraction",
    "seq_masked": "seq_masked_fraction",
}


LOSS_NAMES = tuple(LOSSES)


def finalize_stats(stats: Mapping) -> dict:
    """Turn stat sums into the reported metrics (fractions are over response tokens)."""
    tokens = jnp.maximum(stats["tokens"], 1.0)
    out = {"response_tokens": stats["tokens"], "max_abs_logprob_diff": stats["max_abs_logprob_diff"]}
    out |= {name: stats[k] / tokens for k, name in _PER_TOKEN.items() if k in stats}
    if "mm_tokens" in stats:
        mm = jnp.maximum(stats["mm_tokens"], 1.0)
        known = jnp.maximum(stats["lag_known_tokens"], 1.0)
        out |= {
            "mismatch/tokens": stats["mm_tokens"],
            "mismatch/max_abs_logprob_diff": stats["max_mm_abs_diff"],
            "mismatch/mean_abs_logprob_diff": stats["mm_abs_diff_sum"] / mm,
            "mismatch/kl": stats["mm_kl_sum"] / mm,
            "staleness/off_policy_fraction": stats["off_policy_tokens"] / known,
        }
        for b in range(LAG_BUCKETS):
            label = f"{b}+" if b == LAG_BUCKETS - 1 else str(b)
            out[f"staleness/lag_{label}_fraction"] = stats[f"lag_{b}_tokens"] / known
    return out


# -- public entry points ----------------------------------------------------------------------------
def policy_loss(
    cfg: LossConfig,
    logprobs,
    rollout_logprobs,
    advantages_BxT,
    response_mask,
    segment_ids=None,
    policy_lag=None,
):
    """Any configured objective (``cfg.name``) on per-token advantages; returns (loss, metrics)."""
    check_loss_inputs(logprobs, rollout_logprobs, advantages_BxT, response_mask, per_token=True)
    if segment_ids is None:
        segment_ids = jnp.ones(response_mask.shape, jnp.int32)
    loss_sum, stats = loss_terms(
        cfg, logprobs, rollout_logprobs, advantages_BxT, response_mask, segment_ids, policy_lag
    )
    return loss_sum / loss_normalizer(cfg, response_mask, segment_ids), finalize_stats(stats)


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
    if divergence not in DIVERGENCES:
        raise LossInputError(f"divergence must be one of {tuple(DIVERGENCES)}, got {divergence!r}")
    if not delta >= 0:
        raise LossInputError(f"delta must be >= 0, got {delta}")
    cfg = LossConfig(name="dppo", delta=delta, divergence=divergence)
    return policy_loss(cfg, logprobs, rollout_logprobs, advantages_BxT, response_mask)
