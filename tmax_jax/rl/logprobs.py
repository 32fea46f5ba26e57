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

import functools

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


def head_precision():
    """The one precision policy of the float32 head: where the layer stack's float32 matmuls need an
    explicit precision (``numerics.f32_matmul_precision``: accelerators), ``numerics.head_dot_setting``'s
    algorithm (three bfloat16 passes summed in float32 unless ``TMAX_JAX_F32_DOT`` or the "float32"
    policy says otherwise); else (CPU, whose f32 dot is exact) the default."""
    # Imported here: the models package imports this module.
    from tmax_jax.models.qwen35.numerics import F32_DOT_ALGORITHMS, f32_matmul_precision, head_dot_setting

    if f32_matmul_precision() is None:
        return None
    return F32_DOT_ALGORITHMS[head_dot_setting()]


def head_logits(hidden_NxD: jax.Array, lm_head_DxV: jax.Array, *, vd: bool = False) -> jax.Array:
    """float32 ``hidden @ W`` over any leading dims of ``hidden`` (inputs cast to float32 first).
    ``vd``: the head is given as ``[V, D]`` (a tied embedding as stored) and read that way."""
    return jnp.einsum(
        "...d,vd->...v" if vd else "...d,dv->...v",
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
    hidden_BxTxD,
    lm_head_DxV,
    targets_BxT,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    chunk_size=1024,
    mask_BxT=None,
    head_vd=False,
):
    """float32 [B, T]: ``logprobs_from_logits(hidden @ lm_head, targets, ...)``, chunked over T.

    ``targets`` outside [0, V) give garbage, so mask such positions (padding) downstream; the train
    batch's padding uses target 0.

    ``mask_BxT``: where the caller reads the result (the loss's response tokens). Positions outside
    it get 0.0, and the head runs only on blocks of positions that hold some of it (see
    ``_masked_token_logprobs``): prompts and tool output cost no [*, V] logits.

    ``head_vd``: ``lm_head_DxV`` is given as ``[V, D]`` (a tied embedding as stored), so no
    transposed copy of it is made.
    """
    head_DxV = lm_head_DxV.T if head_vd else lm_head_DxV
    _check(hidden_BxTxD, head_DxV, targets_BxT, temperature)
    if chunk_size <= 0:
        raise LogprobInputError(f"chunk_size must be > 0, got {chunk_size}")
    k, p = _truncation(top_k, top_p)
    if mask_BxT is not None:
        if mask_BxT.shape != targets_BxT.shape:
            raise LogprobInputError(f"mask must be [B, T] = {targets_BxT.shape}, got {mask_BxT.shape}")
        if isinstance(temperature, (int, float)):
            return _masked_token_logprobs(
                hidden_BxTxD, lm_head_DxV, targets_BxT, mask_BxT, temperature, k, p, chunk_size, head_vd
            )
        # A traced temperature (the masked head's backward needs it static): the whole head.
        lp_BxT = token_logprobs(
            hidden_BxTxD, head_DxV, targets_BxT, temperature=temperature, top_k=top_k, top_p=top_p,
            chunk_size=chunk_size,
        )  # fmt: skip
        return jnp.where(mask_BxT > 0, lp_BxT, 0.0)
    lm_head_DxV = head_DxV
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


# The masked head's blocks when a row is one chunk: up to this many, of at least this many rows
# (B x block length) each, so the blocks left out save work while each one run stays a large matmul.
_MAX_HEAD_BLOCKS = 8
_MIN_HEAD_BLOCK_ROWS = 128


@jax.custom_vjp
def _permute(x_BxTxD, order_BxT, inverse_BxT):
    """``x[b, order[b, t]]`` for a per-row permutation ``order`` (``inverse`` its inverse). Its
    gradient is the inverse permutation: a gather, where autodiff of a general gather would emit a
    scatter-add."""
    return jnp.take_along_axis(x_BxTxD, order_BxT[..., None], axis=1)


def _permute_fwd(x, order, inverse):
    return _permute(x, order, inverse), (order, inverse)


def _permute_bwd(res, g):
    order, inverse = res
    return _permute(g, inverse, order), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _masked_token_logprobs(
    hidden_BxTxD, lm_head, targets_BxT, mask_BxT, temperature, k, p, chunk_size, vd=False
):
    """``token_logprobs`` where ``mask`` is set, 0.0 elsewhere, with the head only where it is needed.

    Each row's positions are reordered so its masked-in ones come first (a stable sort: their order
    is kept); the head then runs over blocks of the sorted positions, up to the first block past
    every row's count of masked-in positions (``_prefix_head``: a loop with that trip count, forward
    and backward). Each position's logprob is the one ``token_logprobs`` computes for it, read back
    through the inverse order. Rows stay whole (only T is reordered), so a batch sharded by rows
    stays so. ``lm_head`` is ``[D, V]``, or ``[V, D]`` with ``vd``: the loops read it as stored."""
    B, T, D = hidden_BxTxD.shape
    keep_BxT = mask_BxT > 0
    order_BxT = jnp.argsort(~keep_BxT, axis=1, stable=True).astype(jnp.int32)
    inverse_BxT = jnp.argsort(order_BxT, axis=1).astype(jnp.int32)
    reach = jnp.max(jnp.sum(keep_BxT, axis=1)).astype(jnp.int32)  # sorted [0, reach) holds them all
    h_BxTxD = _permute(hidden_BxTxD, order_BxT, inverse_BxT)
    t_BxT = jnp.take_along_axis(targets_BxT, order_BxT, axis=1).astype(jnp.int32)
    if T <= chunk_size:
        # One chunk, as in token_logprobs: its probabilities are kept for the backward pass.
        n = max(1, min(_MAX_HEAD_BLOCKS, (B * T) // _MIN_HEAD_BLOCK_ROWS))
        size, keep_probs = -(-T // n), True
    else:
        size, keep_probs = chunk_size, False  # one [B, chunk, V] block live at a time, recomputed
    pad = -(-T // size) * size - T
    h_BxTxD = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0)))
    t_BxT = jnp.pad(t_BxT, ((0, 0), (0, pad)))
    lp_BxT = _prefix_head(h_BxTxD, lm_head, t_BxT, reach, size, float(temperature), k, p, keep_probs, vd)
    lp_BxT = _permute(lp_BxT[:, :T, None], inverse_BxT, order_BxT)[..., 0]
    return jnp.where(keep_BxT, lp_BxT, 0.0)


def _head_block(h_BxCxD, w, t_BxC, temperature, k, p, vd):
    """(raw logprob, log-sum-exp, sampling logits) of one block of positions."""
    kept_BxCxV = sampling_logits(head_logits(h_BxCxD, w, vd=vd), temperature, k, p)
    lse_BxC = jax.nn.logsumexp(kept_BxCxV, axis=-1)
    raw_BxC = jnp.take_along_axis(kept_BxCxV, t_BxC[..., None], axis=-1)[..., 0] - lse_BxC
    return raw_BxC, lse_BxC, kept_BxCxV


def _floored(raw_BxT, k, p):
    """The logprob the head reports: the truncation floor applies when a filter is on."""
    return raw_BxT if k is None and p is None else jnp.maximum(raw_BxT, TRUNCATED_LOGPROB_FLOOR)


def _prefix_forward(h_BxTxD, w, t_BxT, reach, size, temperature, k, p, keep_probs, vd):
    B, T, _ = h_BxTxD.shape
    V = w.shape[0 if vd else 1]
    blocks = (reach + size - 1) // size
    bufs = (jnp.zeros((B, T), jnp.float32), jnp.zeros((B, T), jnp.float32))
    if keep_probs:
        bufs += (jnp.zeros((B, T, V), jnp.float32),)

    def body(i, bufs):
        at = i * size
        h = jax.lax.dynamic_slice_in_dim(h_BxTxD, at, size, axis=1)
        t = jax.lax.dynamic_slice_in_dim(t_BxT, at, size, axis=1)
        raw, lse, kept = _head_block(h, w, t, temperature, k, p, vd)
        outs = (raw, lse) + ((jnp.exp(kept - lse[..., None]),) if keep_probs else ())
        return tuple(jax.lax.dynamic_update_slice_in_dim(b, o, at, axis=1) for b, o in zip(bufs, outs))

    return jax.lax.fori_loop(0, blocks, body, bufs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _prefix_head(h_BxTxD, w, t_BxT, reach, size, temperature, k, p, keep_probs, vd):
    """float32 [B, T] logprobs of the first ``ceil(reach / size)`` blocks of ``size`` positions (zeros
    after), with its own backward pass over the same blocks: no [B, T, V] work past ``reach``."""
    return _floored(_prefix_forward(h_BxTxD, w, t_BxT, reach, size, temperature, k, p, False, vd)[0], k, p)


def _prefix_head_fwd(h_BxTxD, w, t_BxT, reach, size, temperature, k, p, keep_probs, vd):
    raw, lse, *probs = _prefix_forward(h_BxTxD, w, t_BxT, reach, size, temperature, k, p, keep_probs, vd)
    return _floored(raw, k, p), (h_BxTxD, w, t_BxT, reach, raw, lse, tuple(probs))


def _prefix_head_bwd(size, temperature, k, p, keep_probs, vd, res, g_BxT):
    """d lp / d logits = (onehot(target) - softmax(sampling logits)) / T over the kept support (the
    truncation threshold is a comparison: no gradient), zero where the floor clipped the logprob."""
    h_BxTxD, w, t_BxT, reach, raw_BxT, lse_BxT, probs = res
    inv_t = 1.0 if temperature <= GREEDY_EPS else 1.0 / temperature
    truncating = not (k is None and p is None)
    coef_BxT = g_BxT.astype(jnp.float32) * inv_t
    if truncating:
        coef_BxT = jnp.where(raw_BxT > TRUNCATED_LOGPROB_FLOOR, coef_BxT, 0.0)
    w32 = w.astype(jnp.float32)
    blocks = (reach + size - 1) // size

    def block_grad(i):  # (block start, its hidden states, d loss / d logits of the block)
        at = i * size
        h = jax.lax.dynamic_slice_in_dim(h_BxTxD, at, size, axis=1)
        t = jax.lax.dynamic_slice_in_dim(t_BxT, at, size, axis=1)
        coef = jax.lax.dynamic_slice_in_dim(coef_BxT, at, size, axis=1)
        if keep_probs:
            p_BxCxV = jax.lax.dynamic_slice_in_dim(probs[0], at, size, axis=1)
        else:
            lse = jax.lax.dynamic_slice_in_dim(lse_BxT, at, size, axis=1)
            kept = sampling_logits(head_logits(h, w, vd=vd), temperature, k, p)
            p_BxCxV = jnp.exp(kept - lse[..., None])
        hit = jax.lax.broadcasted_iota(jnp.int32, p_BxCxV.shape, 2) == t[..., None]
        return at, h, coef[..., None] * (hit.astype(jnp.float32) - p_BxCxV)

    def d_hidden(at, d_BxCxV, dh_BxTxD):
        dh = jnp.einsum("bcv,vd->bcd" if vd else "bcv,dv->bcd", d_BxCxV, w32, precision=head_precision())
        return jax.lax.dynamic_update_slice_in_dim(dh_BxTxD, dh.astype(dh_BxTxD.dtype), at, axis=1)

    def d_head(h, d_BxCxV, dw_DxV):
        # Summed as [D, V] whatever the head's layout: as [V, D] XLA would transpose every block's
        # [B, C, V] cotangent for the matmul (on CPU ~0.2 s per 1024 x 32K block); one transpose of
        # the sum at the end instead.
        return dw_DxV + jnp.einsum("bcd,bcv->dv", h.astype(jnp.float32), d_BxCxV, precision=head_precision())

    dh0 = jnp.zeros(h_BxTxD.shape, h_BxTxD.dtype)
    dw0 = jnp.zeros(w.T.shape if vd else w.shape, jnp.float32)
    if keep_probs:
        # Two loops over the kept probabilities: the layers' backward waits only for the first (the
        # hidden states' gradient) and runs beside the second (the head's).
        def hidden_body(i, dh):
            at, _, d = block_grad(i)
            return d_hidden(at, d, dh)

        def head_body(i, dw):
            _, h, d = block_grad(i)
            return d_head(h, d, dw)

        dh_BxTxD = jax.lax.fori_loop(0, blocks, hidden_body, dh0)
        dw_DxV = jax.lax.fori_loop(0, blocks, head_body, dw0)
    else:  # recomputed logits: one loop, both gradients from each block's one recompute

        def body(i, carry):
            at, h, d = block_grad(i)
            return d_hidden(at, d, carry[0]), d_head(h, d, carry[1])

        dh_BxTxD, dw_DxV = jax.lax.fori_loop(0, blocks, body, (dh0, dw0))
    return dh_BxTxD, (dw_DxV.T if vd else dw_DxV).astype(w.dtype), None, None


_prefix_head.defvjp(_prefix_head_fwd, _prefix_head_bwd)
