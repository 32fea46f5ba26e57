"""Token sampling with per-slot temperature / top-k / top-p / seed, and the sampled token's logprob.

The logprob returned for every token is the one DPPO uses as ``rollout_logprobs``: the float32
log-softmax of ``logits / T`` at the sampled token (of the plain logits when ``T == 0``). Top-k and
top-p only restrict *which* tokens can be drawn; the reported logprob stays the untruncated
tempered one, because that is the quantity the trainer can recompute from the same weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tmax_jax.errors import ConfigError
from tmax_jax.rl.logprobs import logprobs_from_logits

# Temperatures at or below this are treated as greedy; dividing by them would overflow float32.
GREEDY_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled. ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ConfigError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")


def token_logprob(logits_SxV: jax.Array, tokens_S: jax.Array, temperature_S: jax.Array) -> jax.Array:
    """float32 log-softmax(logits / T) at ``tokens`` (plain logits where T is greedy)."""
    return logprobs_from_logits(logits_SxV, tokens_S, temperature_S)


# Rows that ask only for top-k with k up to this take a partial top-k (no sort of the vocabulary).
PARTIAL_TOP_K = 256


def _threshold_filter(scaled_SxV: jax.Array, threshold_S: jax.Array) -> jax.Array:
    return jnp.where(scaled_SxV >= threshold_S[:, None], scaled_SxV, -jnp.inf)


def filter_logits(scaled_SxV: jax.Array, top_k_S: jax.Array, top_p_S: jax.Array) -> jax.Array:
    """Set logits outside each row's top-k / nucleus to -inf (ties at the boundary are kept)."""
    vocab = scaled_SxV.shape[-1]
    sorted_SxV = jnp.sort(scaled_SxV, axis=-1, descending=True)
    k_S = jnp.where(top_k_S <= 0, vocab, jnp.minimum(top_k_S, vocab))
    kth_S = jnp.take_along_axis(sorted_SxV, (k_S - 1)[:, None], axis=-1)[:, 0]
    # Nucleus: keep the smallest prefix of the sorted tokens whose mass reaches top_p; a token is in
    # it when the mass strictly before it is still below top_p (so the top token is always kept).
    probs_SxV = jax.nn.softmax(sorted_SxV, axis=-1)
    mass_before_SxV = jnp.cumsum(probs_SxV, axis=-1) - probs_SxV
    in_nucleus_SxV = mass_before_SxV < top_p_S[:, None]
    n_keep_S = jnp.maximum(jnp.sum(in_nucleus_SxV, axis=-1), 1)
    pth_S = jnp.take_along_axis(sorted_SxV, (n_keep_S - 1)[:, None], axis=-1)[:, 0]
    threshold_S = jnp.maximum(kth_S, jnp.where(top_p_S >= 1.0, -jnp.inf, pth_S))
    return _threshold_filter(scaled_SxV, threshold_S)


def filter_top_k_partial(scaled_SxV: jax.Array, top_k_S: jax.Array, max_k: int) -> jax.Array:
    """:func:`filter_logits` for rows without top-p whose ``top_k <= max_k`` (0 = off), from a
    partial ``lax.top_k`` of ``max_k`` instead of a sort: the k-th largest value is the same."""
    vocab = scaled_SxV.shape[-1]
    max_k = min(max_k, vocab)
    top_SxK, _ = jax.lax.top_k(scaled_SxV, max_k)
    k_S = jnp.clip(top_k_S, 1, max_k)
    kth_S = jnp.take_along_axis(top_SxK, (k_S - 1)[:, None], axis=-1)[:, 0]
    return _threshold_filter(scaled_SxV, jnp.where(top_k_S <= 0, -jnp.inf, kth_S))


def _filter_kind(top_k_S: jax.Array, top_p_S: jax.Array, vocab: int) -> jax.Array:
    """0: no row filters; 1: only top-k rows within the partial bound; 2: the full sort."""
    wants_S = (top_k_S > 0) | (top_p_S < 1.0)
    partial_ok = jnp.all((top_p_S >= 1.0) & (top_k_S <= min(PARTIAL_TOP_K, vocab)))
    return jnp.where(jnp.any(wants_S), jnp.where(partial_ok, 1, 2), 0)


def sample(
    logits_SxV: jax.Array,
    keys_S: jax.Array,
    temperature_S: jax.Array,
    top_k_S: jax.Array,
    top_p_S: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row; returns (tokens int32 [S], logprobs float32 [S]).

    ``keys_S`` holds one typed PRNG key per row, so a row's draw does not depend on its neighbours
    (continuous batching gives the same samples as one request at a time). The vocabulary is sorted
    only when a row asks for top-p (or a top-k past :data:`PARTIAL_TOP_K`), and no random draw is
    made when every row is greedy; either way the tokens are those of the full computation.
    """
    logits_SxV = logits_SxV.astype(jnp.float32)
    vocab = logits_SxV.shape[-1]
    greedy_S = temperature_S <= GREEDY_EPS
    safe_t_S = jnp.where(greedy_S, 1.0, temperature_S).astype(jnp.float32)
    scaled_SxV = logits_SxV / safe_t_S[:, None]

    def draw(scaled):
        filtered = jax.lax.switch(
            _filter_kind(top_k_S, top_p_S, vocab),
            [
                lambda x: x,
                lambda x: filter_top_k_partial(x, top_k_S, PARTIAL_TOP_K),
                lambda x: filter_logits(x, top_k_S, top_p_S),
            ],
            scaled,
        )
        return jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys_S, filtered).astype(jnp.int32)

    drawn_S = jax.lax.cond(jnp.all(greedy_S), lambda x: jnp.zeros(x.shape[:1], jnp.int32), draw, scaled_SxV)
    tokens_S = jnp.where(greedy_S, jnp.argmax(logits_SxV, axis=-1), drawn_S).astype(jnp.int32)
    logprobs_S = logprobs_from_logits(logits_SxV, tokens_S, temperature_S)
    return tokens_S, logprobs_S


def step_keys(base_keys_S: jax.Array, step_S: jax.Array) -> jax.Array:
    """The key for a row's ``step``-th generated token: a pure function of (request seed, step)."""
    return jax.vmap(jax.random.fold_in)(base_keys_S, step_S.astype(jnp.uint32))


def request_key(seed: int) -> jax.Array:
    return jax.random.key(seed)
