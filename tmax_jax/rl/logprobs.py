"""Per-token logprobs from hidden states with a float32 LM head, chunked over the sequence.

The one definition of a token's logprob shared by the trainer and the rollout engine:
``log_softmax(hidden @ W / temperature)[target]`` in float32. At a 248K vocabulary and 64K tokens the
full [B, T, V] logits would be ~60 GiB in float32, so the head runs over sequence chunks inside a
``lax.scan`` whose body is rematerialised: forward and backward each hold one [B, chunk, V] buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tmax_jax.errors import TmaxError

_HEAD_PRECISION = jax.lax.Precision.HIGHEST


class LogprobInputError(TmaxError, ValueError):
    """hidden / lm_head / targets disagree in shape or dtype."""


def _check(hidden_BxTxD, lm_head_DxV, targets_BxT, temperature) -> None:
    if hidden_BxTxD.ndim != 3:
        raise LogprobInputError(f"hidden must be [B, T, D], got shape {hidden_BxTxD.shape}")
    if lm_head_DxV.ndim != 2 or lm_head_DxV.shape[0] != hidden_BxTxD.shape[2]:
        raise LogprobInputError(
            f"lm_head must be [D, V] with D = {hidden_BxTxD.shape[2]}, got shape {lm_head_DxV.shape}"
        )
    if targets_BxT.shape != hidden_BxTxD.shape[:2]:
        raise LogprobInputError(f"targets must be [B, T] = {hidden_BxTxD.shape[:2]}, got {targets_BxT.shape}")
    if not jnp.issubdtype(targets_BxT.dtype, jnp.integer):
        raise LogprobInputError(f"targets must be integer token ids, got {targets_BxT.dtype}")
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise LogprobInputError(f"temperature must be > 0, got {temperature}")


def _chunk_logprobs(h_BxCxD, w_DxV, t_BxC, inv_temp):
    logits_BxCxV = jnp.einsum(
        "bcd,dv->bcv", h_BxCxD.astype(jnp.float32), w_DxV.astype(jnp.float32), precision=_HEAD_PRECISION
    )
    logits_BxCxV = logits_BxCxV * inv_temp
    lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
    picked_BxC = jnp.take_along_axis(logits_BxCxV, t_BxC[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked_BxC - lse_BxC


def token_logprobs_plain(hidden_BxTxD, lm_head_DxV, targets_BxT, *, temperature=1.0):
    """Reference: the full [B, T, V] float32 logits at once (tests, short sequences)."""
    _check(hidden_BxTxD, lm_head_DxV, targets_BxT, temperature)
    return _chunk_logprobs(hidden_BxTxD, lm_head_DxV, targets_BxT, 1.0 / jnp.float32(temperature))


def token_logprobs(hidden_BxTxD, lm_head_DxV, targets_BxT, *, temperature=1.0, chunk_size=1024):
    """float32 [B, T]: log_softmax(hidden @ lm_head / temperature) at ``targets``, chunked over T.

    ``targets`` outside [0, V) give garbage, so mask such positions (padding) downstream; the train
    batch's padding uses target 0.
    """
    _check(hidden_BxTxD, lm_head_DxV, targets_BxT, temperature)
    if chunk_size <= 0:
        raise LogprobInputError(f"chunk_size must be > 0, got {chunk_size}")
    B, T, D = hidden_BxTxD.shape
    inv_temp = 1.0 / jnp.asarray(temperature, jnp.float32)
    if T <= chunk_size:
        return jax.checkpoint(_chunk_logprobs)(hidden_BxTxD, lm_head_DxV, targets_BxT, inv_temp)
    n_chunks = -(-T // chunk_size)
    pad = n_chunks * chunk_size - T
    h = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
    t = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
    # [n, B, C, ...]: scan over chunks; the body is remat'd so only [B, C, V] is ever live.
    h_NxBxCxD = h.reshape(B, n_chunks, chunk_size, D).swapaxes(0, 1)
    t_NxBxC = t.reshape(B, n_chunks, chunk_size).swapaxes(0, 1)
    body = jax.checkpoint(lambda hc, tc: _chunk_logprobs(hc, lm_head_DxV, tc, inv_temp))

    def step(carry, xs):
        return carry, body(*xs)

    _, lp_NxBxC = jax.lax.scan(step, None, (h_NxBxCxD, t_NxBxC))
    return lp_NxBxC.swapaxes(0, 1).reshape(B, n_chunks * chunk_size)[:, :T]
