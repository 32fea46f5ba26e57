"""The policy head: float32 token log-probabilities under temperature (and top-k / top-p truncation).

One definition shared by the rollout engine's sampler, the RL trainer and SFT, so DPPO's premise
(trainer and engine compute the same probabilities) holds by construction:

* ``head_logits(hidden, W)``: the float32 LM head, ``hidden @ W`` at ``head_precision()``;
* ``logprobs_from_logits(logits, tokens, temperature, top_k, top_p)``: the float32
  ``log_softmax(logits / T)`` at ``tokens``, optionally over the truncated (top-k / nucleus) support;
* ``token_logprobs(hidden, W, targets, ...)``: both, chunked over the sequence for training.

At a 248K vocabulary and 64K tokens the full [B, T, V] logits would be ~60 GiB in float32, so
``token_logprobs`` runs the head over sequence chunks inside a ``lax.scan`` whose body is
rematerialised: forward and backward each hold one [B, chunk, V] buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tmax_jax.errors import TmaxError

# Temperatures at or below this are greedy: the logprob is that of the plain (T = 1) logits.
GREEDY_EPS = 1e-5
# A target outside the truncated support has probability 0 there; its logprob is floored here so
# masked positions (prompt, padding) never turn sums into inf * 0 = NaN. exp(-100) ~ 4e-44.
TRUNCATED_LOGPROB_FLOOR = -100.0


class LogprobInputError(TmaxError, ValueError):
    """hidden / lm_head / targets disagree in shape or dtype."""


def head_precision() -> jax.lax.Precision | None:
    """The one precision policy of the float32 head: HIGHEST on accelerators, whose default f32 dot
    may round inputs (TF32 / bf16 passes); the default on CPU, whose f32 dot is already exact (and
    where HIGHEST was seen to deadlock XLA's thread pool next to LAPACK solves on 2 cores)."""
    return None if jax.default_backend() == "cpu" else jax.lax.Precision.HIGHEST


def head_logits(hidden_NxD: jax.Array, lm_head_DxV: jax.Array) -> jax.Array:
    """float32 ``hidden @ W`` over any leading dims of ``hidden`` (inputs cast to float32 first)."""
    return jnp.einsum(
        "...d,dv->...v",
        hidden_NxD.astype(jnp.float32),
        lm_head_DxV.astype(jnp.float32),
        precision=head_precision(),
        preferred_element_type=jnp.float32,
    )


def tempered(logits_NxV: jax.Array, temperature) -> jax.Array:
    """float32 ``logits / T`` with T broadcast over the leading dims (greedy T counts as 1)."""
    t_N = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), logits_NxV.shape[:-1])
    t_N = jnp.where(t_N <= GREEDY_EPS, 1.0, t_N)
    return logits_NxV.astype(jnp.float32) / t_N[..., None]


# Rows whose truncation is decided by their PARTIAL_TOP_K largest logits (a top-k with k up to it, or
# a nucleus whose mass those logits reach) get their threshold from a partial top-k: no sort.
PARTIAL_TOP_K = 256


def _nucleus_count(head_NxK: jax.Array, lse_N: jax.Array, top_p_N: jax.Array):
    """(how many of the descending ``head`` logits are in the nucleus, their total probability).

    The probabilities are taken against the whole vocabulary's ``lse`` (a reduction over the
    unsorted logits), and the running mass over the head alone: the full-sort and the partial path
    both call this on the same head values, so they agree bit for bit wherever the head decides."""
    probs_NxK = jnp.exp(head_NxK - lse_N[..., None])
    running_NxK = jnp.cumsum(probs_NxK, axis=-1)
    n_head = jnp.sum(running_NxK - probs_NxK < top_p_N[..., None], axis=-1)
    return n_head, running_NxK[..., -1]


def truncation_threshold(scaled_NxV: jax.Array, top_k, top_p) -> jax.Array:
    """Per position, the smallest scaled logit still drawable under top-k and top-p (ties kept).

    ``top_k <= 0`` and ``top_p >= 1`` disable either filter. The nucleus is the smallest prefix of
    the sorted tokens whose mass reaches ``top_p``: a token is in it when the mass strictly before
    it is still below ``top_p`` (so the top token is always kept). This is the full-sort form; see
    :func:`truncate` for the one that skips the sort when it can (same numbers where both apply).
    """
    scaled_NxV = jax.lax.stop_gradient(scaled_NxV)
    vocab = scaled_NxV.shape[-1]
    lead = scaled_NxV.shape[:-1]
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), lead)
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), lead)
    sorted_NxV = jnp.sort(scaled_NxV, axis=-1, descending=True)
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))
    kth = jnp.take_along_axis(sorted_NxV, (k - 1)[..., None], axis=-1)[..., 0]
    head = min(PARTIAL_TOP_K, vocab)
    lse = jax.nn.logsumexp(scaled_NxV, axis=-1)
    n_head, head_mass = _nucleus_count(sorted_NxV[..., :head], lse, top_p)
    tail_NxR = jnp.exp(sorted_NxV[..., head:] - lse[..., None])
    tail_before_NxR = head_mass[..., None] + jnp.cumsum(tail_NxR, axis=-1) - tail_NxR
    n_keep = jnp.maximum(n_head + jnp.sum(tail_before_NxR < top_p[..., None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_NxV, (n_keep - 1)[..., None], axis=-1)[..., 0]
    return jnp.maximum(kth, jnp.where(top_p >= 1.0, -jnp.inf, pth))


def _kth_in_head(head_NxK: jax.Array, top_k_N: jax.Array) -> jax.Array:
    """The k-th largest logit from the descending ``head`` (k clipped to it; -inf where k <= 0)."""
    head = head_NxK.shape[-1]
    kth = jnp.take_along_axis(head_NxK, (jnp.clip(top_k_N, 1, head) - 1)[..., None], axis=-1)[..., 0]
    return jnp.where(top_k_N <= 0, -jnp.inf, kth)


def _top_k_threshold(scaled_NxV: jax.Array, top_k) -> jax.Array:
    """:func:`truncation_threshold` without top-p for ``top_k <= PARTIAL_TOP_K`` (0 = off), from a
    partial ``lax.top_k``: its k-th value is the sorted one. No pass over the vocabulary's mass."""
    scaled_NxV = jax.lax.stop_gradient(scaled_NxV)
    head_NxK, _ = jax.lax.top_k(scaled_NxV, min(PARTIAL_TOP_K, scaled_NxV.shape[-1]))
    return _kth_in_head(head_NxK, jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), scaled_NxV.shape[:-1]))


def _partial_threshold(scaled_NxV: jax.Array, top_k, top_p):
    """(:func:`truncation_threshold` from a partial ``lax.top_k`` of PARTIAL_TOP_K, whether that is
    exact for every row). It is where a row's top-k is at most PARTIAL_TOP_K and it asks for no
    nucleus, or where it asks for a nucleus that the head's mass reaches (then the nucleus ends
    inside the head, at or above any k-th value)."""
    scaled_NxV = jax.lax.stop_gradient(scaled_NxV)
    vocab = scaled_NxV.shape[-1]
    head = min(PARTIAL_TOP_K, vocab)
    lead = scaled_NxV.shape[:-1]
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), lead)
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), lead)
    head_NxK, _ = jax.lax.top_k(scaled_NxV, head)
    kth = _kth_in_head(head_NxK, top_k)
    n_head, head_mass = _nucleus_count(head_NxK, jax.nn.logsumexp(scaled_NxV, axis=-1), top_p)
    pth = jnp.take_along_axis(head_NxK, (jnp.maximum(n_head, 1) - 1)[..., None], axis=-1)[..., 0]
    nucleus = top_p < 1.0
    exact = jnp.where(nucleus, (head_mass >= top_p) | (head == vocab), (top_k <= head) | (head == vocab))
    return jnp.maximum(kth, jnp.where(nucleus, pth, -jnp.inf)), jnp.all(exact)


def _nucleus_threshold(scaled_NxV: jax.Array, top_k, top_p) -> jax.Array:
    """The truncation threshold when some row asks for a nucleus: from the partial top-k when it is
    exact for every row, else from the full sort (the partial top-k's cost is then added to it)."""
    thr_N, exact = _partial_threshold(scaled_NxV, top_k, top_p)
    return jax.lax.cond(exact, lambda x: thr_N, lambda x: truncation_threshold(x, top_k, top_p), scaled_NxV)


def _no_threshold(scaled_NxV: jax.Array) -> jax.Array:
    return jnp.full(scaled_NxV.shape[:-1], -jnp.inf, jnp.float32)


def _is_static(x) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))


def truncate(scaled_NxV: jax.Array, top_k=None, top_p=None) -> jax.Array:
    """``scaled`` with every logit outside the top-k / nucleus support set to -inf: the logits the
    sampler draws from and the truncated logprobs are taken over.

    Static ``top_k`` / ``top_p`` (Python numbers or None: the trainer) pick the computation at trace
    time; arrays (one value per position: the engine's slots) pick it at run time. Either way the
    threshold comes from a partial top-k of :data:`PARTIAL_TOP_K` logits unless some position asks
    for a top-k past it (without a nucleus) or for a nucleus whose mass those logits do not reach;
    only then is the vocabulary sorted. Nothing is done when no position asks for truncation.
    """
    if _is_static(top_k) and _is_static(top_p):
        k = 0 if top_k is None else int(top_k)
        p = 1.0 if top_p is None else float(top_p)
        if k <= 0 and p >= 1.0:
            return scaled_NxV
        if p < 1.0:
            thr_N = _nucleus_threshold(scaled_NxV, k, p)
        elif k <= PARTIAL_TOP_K:
            thr_N = _top_k_threshold(scaled_NxV, k)
        else:
            thr_N = truncation_threshold(scaled_NxV, k, p)
    else:
        lead = scaled_NxV.shape[:-1]
        k_N = jnp.broadcast_to(jnp.asarray(0 if top_k is None else top_k, jnp.int32), lead)
        p_N = jnp.broadcast_to(jnp.asarray(1.0 if top_p is None else top_p, jnp.float32), lead)
        wants = jnp.any((k_N > 0) | (p_N < 1.0))
        top_k_only = jnp.all((p_N >= 1.0) & (k_N <= min(PARTIAL_TOP_K, scaled_NxV.shape[-1])))
        kind = jnp.where(wants, jnp.where(top_k_only, 1, 2), 0)
        thr_N = jax.lax.switch(
            kind,
            [
                _no_threshold,
                lambda x: _top_k_threshold(x, k_N),
                lambda x: _nucleus_threshold(x, k_N, p_N),
            ],
            scaled_NxV,
        )
    return jnp.where(scaled_NxV >= thr_N[..., None], scaled_NxV, -jnp.inf)


def sampling_logits(logits_NxV: jax.Array, temperature=1.0, top_k=None, top_p=None) -> jax.Array:
    """float32 logits of the distribution a token is drawn from: ``logits / T`` (greedy T counts as
    1), truncated to the top-k / nucleus support. The sampler draws from these; the logprob of a
    token is :func:`logprob_at` of them."""
    return truncate(tempered(logits_NxV, temperature), top_k, top_p)


def logprob_at(sampling_NxV: jax.Array, tokens_N: jax.Array, *, floor: bool = True) -> jax.Array:
    """float32 ``log_softmax(sampling_logits)`` at ``tokens``; a token outside a truncated support
    gets :data:`TRUNCATED_LOGPROB_FLOOR` when ``floor``."""
    lse_N = jax.nn.logsumexp(sampling_NxV, axis=-1)
    picked_N = jnp.take_along_axis(sampling_NxV, tokens_N[..., None].astype(jnp.int32), axis=-1)[..., 0]
    lp_N = picked_N - lse_N
    return jnp.maximum(lp_N, TRUNCATED_LOGPROB_FLOOR) if floor else lp_N


def logprobs_from_logits(logits_NxV, tokens_N, temperature=1.0, top_k=None, top_p=None) -> jax.Array:
    """float32 log-probability of ``tokens`` under ``softmax(logits / T)``.

    With ``top_k`` / ``top_p`` given (scalars or one per position), the distribution is the
    truncated one the sampler draws from: renormalised over the kept tokens; a token outside it
    gets ``TRUNCATED_LOGPROB_FLOOR``. ``None`` for both: the untruncated tempered distribution.
    Exactly ``logprob_at(sampling_logits(logits, T, top_k, top_p), tokens)``, which the engine's
    sampler computes (sharing the truncation with its draw).
    """
    truncating = not (top_k is None and top_p is None)
    return logprob_at(sampling_logits(logits_NxV, temperature, top_k, top_p), tokens_N, floor=truncating)


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


def _truncation(top_k: int, top_p: float) -> tuple:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise LogprobInputError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise LogprobInputError(f"top_p must be in (0, 1], got {top_p!r}")
    # Static: the sort behind truncation is only traced when a filter is on.
    return (None, None) if top_k == 0 and top_p >= 1.0 else (top_k, top_p)


def token_logprobs_plain(hidden_BxTxD, lm_head_DxV, targets_BxT, *, temperature=1.0, top_k=0, top_p=1.0):
    """Reference: the full [B, T, V] float32 logits at once (tests, short sequences)."""
    _check(hidden_BxTxD, lm_head_DxV, targets_BxT, temperature)
    k, p = _truncation(top_k, top_p)
    return logprobs_from_logits(head_logits(hidden_BxTxD, lm_head_DxV), targets_BxT, temperature, k, p)


def token_logprobs(
    hidden_BxTxD, lm_head_DxV, targets_BxT, *, temperature=1.0, top_k=0, top_p=1.0, chunk_size=1024
):
    """float32 [B, T]: ``logprobs_from_logits(hidden @ lm_head, targets, ...)``, chunked over T.

    ``targets`` outside [0, V) give garbage, so mask such positions (padding) downstream; the train
    batch's padding uses target 0.
    """
    _check(hidden_BxTxD, lm_head_DxV, targets_BxT, temperature)
    if chunk_size <= 0:
        raise LogprobInputError(f"chunk_size must be > 0, got {chunk_size}")
    k, p = _truncation(top_k, top_p)
    B, T, D = hidden_BxTxD.shape

    def chunk(h_BxCxD, t_BxC):
        return logprobs_from_logits(head_logits(h_BxCxD, lm_head_DxV), t_BxC, temperature, k, p)

    if T <= chunk_size:
        # One chunk: no checkpoint. The head is the forward pass's last op and its backward the
        # first, so the saved logits are dead before the layers' backward starts; a checkpoint would
        # only compute the [B, T, V] matmul a second time (a third of a 75M CPU step's head time).
        return chunk(hidden_BxTxD, targets_BxT)
    n_chunks = -(-T // chunk_size)
    pad = n_chunks * chunk_size - T
    h = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
    t = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
    # [n, B, C, ...]: scan over chunks; the body is remat'd so only [B, C, V] is ever live.
    h_NxBxCxD = h.reshape(B, n_chunks, chunk_size, D).swapaxes(0, 1)
    t_NxBxC = t.reshape(B, n_chunks, chunk_size).swapaxes(0, 1)
    body = jax.checkpoint(chunk)

    def step(carry, xs):
        return carry, body(*xs)

    _, lp_NxBxC = jax.lax.scan(step, None, (h_NxBxCxD, t_NxBxC))
    return lp_NxBxC.swapaxes(0, 1).reshape(B, n_chunks * chunk_size)[:, :T]
