"""Token sampling with per-slot temperature / top-k / top-p / seed, and the sampled token's logprob.

The logprob returned for every token is the one DPPO uses as ``rollout_logprobs``: the float32
logprob of the sampled token under the distribution it was drawn from, ``softmax(logits / T)``
renormalised over the row's top-k / nucleus support (the plain logits' when ``T == 0``). It comes
from the policy head's functions (``tmax_jax.rl.logprobs``), so a trainer with the same
``loss.temperature`` / ``top_k`` / ``top_p`` recomputes exactly it from the same weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tmax_jax.errors import ConfigError
from tmax_jax.rl.logprobs import GREEDY_EPS, logprob_at, logprobs_from_logits, sampling_logits, truncate

__all__ = [
    "GREEDY_EPS",
    "SamplingParams",
    "derive_seed",
    "filter_logits",
    "first_argmax",
    "request_key",
    "sample",
    "step_keys",
    "token_logprob",
]


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
    """float32 log-softmax(logits / T) at ``tokens`` (plain logits where T is greedy), untruncated."""
    return logprobs_from_logits(logits_SxV, tokens_S, temperature_S)


def filter_logits(scaled_SxV: jax.Array, top_k_S: jax.Array, top_p_S: jax.Array) -> jax.Array:
    """Set logits outside each row's top-k / nucleus to -inf (ties at the boundary are kept)."""
    return truncate(scaled_SxV, top_k_S, top_p_S)


def sample(
    logits_SxV: jax.Array,
    keys_S: jax.Array,
    temperature_S: jax.Array,
    top_k_S: jax.Array,
    top_p_S: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row; returns (tokens int32 [S], logprobs float32 [S]).

    The logprob is that of the distribution the token was drawn from, through the policy head's own
    functions: ``logprobs_from_logits(logits, tokens, T, top_k, top_p)`` (the tempered softmax,
    renormalised over the top-k / nucleus support when a row truncates). A greedy row (T = 0) takes
    the argmax and reports its untruncated T = 1 logprob.

    ``keys_S`` holds one typed PRNG key per row, so a row's draw does not depend on its neighbours
    (continuous batching gives the same samples as one request at a time). The vocabulary is sorted
    only when a row asks for a top-k past ``PARTIAL_TOP_K`` or a nucleus that many logits do not
    reach, and no random draw is made when every row is greedy; either way the tokens are those of
    the full computation.
    """
    logits_SxV = logits_SxV.astype(jnp.float32)
    greedy_S = temperature_S <= GREEDY_EPS
    top_k_S = jnp.where(greedy_S, 0, top_k_S)
    top_p_S = jnp.where(greedy_S, 1.0, top_p_S)
    # The same truncated logits feed the draw and the logprob (one sort at most).
    kept_SxV = sampling_logits(logits_SxV, temperature_S, top_k_S, top_p_S)

    V = logits_SxV.shape[-1]

    def noisy(kept):  # jax.random.categorical's Gumbel-max draw, noise added the same way
        return gumbel_rows(keys_S, V, kept.dtype) + kept

    # One argmax for every row: of the logits where greedy, of Gumbel noise + kept logits where not
    # (no random draw at all when every row is greedy).
    scores_SxV = jax.lax.cond(
        jnp.all(greedy_S),
        lambda kept: logits_SxV,
        lambda kept: jnp.where(greedy_S[:, None], logits_SxV, noisy(kept)),
        kept_SxV,
    )
    tokens_S = first_argmax(scores_SxV)
    return tokens_S, logprob_at(kept_SxV, tokens_S)


# Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011),
# the block function of JAX's default PRNG: rotation constants of the even and odd groups of four
# rounds, and the parity word of the key schedule.
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = np.uint32(0x1BD11BDA)


def threefry2x32(k0: jax.Array, k1: jax.Array, c0: jax.Array, c1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 block function of key (k0, k1) at counter (c0, c1): uint32 arrays that
    broadcast together. The 20 rounds are written out, so XLA fuses the whole hash into one
    elementwise pass (JAX's own CPU lowering runs them as a five-trip loop over the whole array)."""
    u32 = np.uint32
    keys = (k0, k1, k0 ^ k1 ^ _THREEFRY_PARITY)
    x0, x1 = c0 + keys[0], c1 + keys[1]
    for group in range(5):
        for r in _THREEFRY_ROTATIONS[group % 2]:
            x0 = x0 + x1
            x1 = ((x1 << u32(r)) | (x1 >> u32(32 - r))) ^ x0
        x0 = x0 + keys[(group + 1) % 3]
        x1 = x1 + keys[(group + 2) % 3] + u32(group + 1)
    return x0, x1


def gumbel_rows(keys_S: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """``[S, n]`` Gumbel noise, row s drawn with ``keys_S[s]``: bit for bit
    ``jax.vmap(lambda k: jax.random.gumbel(k, (n,), dtype))(keys_S)``.

    On CPU, where JAX's Threefry lowering is a rolled loop, this is ~5x faster (8 x 4,096 draws:
    ~33 vs ~160 us for the bits). It draws the bits as JAX's partitionable Threefry does (counter
    = flat index, output = the XOR of the two words) and turns them into noise as its low-range
    Gumbel does (23 bits -> uniform in [tiny, 1) -> -log(-log(u))); where JAX would draw otherwise
    (another PRNG implementation, non-partitionable Threefry, high-range Gumbel, not float32) it
    calls JAX."""
    dtype = jnp.dtype(dtype)
    if (
        str(jax.random.key_impl(keys_S)) != "threefry2x32"
        or not jax.config.jax_threefry_partitionable
        or jax.config.jax_high_dynamic_range_gumbel
        or dtype != jnp.float32
        or n >= 2**32
    ):
        return jax.vmap(lambda k: jax.random.gumbel(k, (n,), dtype))(keys_S)
    data_Sx2 = jax.random.key_data(keys_S)
    counter_1xN = jnp.arange(n, dtype=jnp.uint32)[None]
    w0, w1 = threefry2x32(data_Sx2[:, :1], data_Sx2[:, 1:], jnp.zeros_like(counter_1xN), counter_1xN)
    bits = w0 ^ w1
    # The top 23 bits as the mantissa of a float in [1, 2), minus 1: uniform in [0, 1); then moved
    # onto [tiny, 1) so that both logarithms are finite.
    one = np.float32(1.0)
    u = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | one.view(np.uint32), jnp.float32) - one
    tiny = np.float32(np.finfo(np.float32).tiny)
    u = jnp.maximum(tiny, u * (one - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def first_argmax(x_SxV: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as int32 (the first maximum; the first NaN where a row has one),
    computed as a max then a min over the positions that hold it: two plain reductions, which XLA's
    CPU backend runs ~5x faster than argmax's variadic reduce on a 248K vocabulary."""
    m_Sx1 = jnp.max(x_SxV, axis=-1, keepdims=True)
    hit_SxV = (x_SxV == m_Sx1) | jnp.isnan(x_SxV)
    pos_SxV = jax.lax.broadcasted_iota(jnp.int32, x_SxV.shape, x_SxV.ndim - 1)
    return jnp.min(jnp.where(hit_SxV, pos_SxV, x_SxV.shape[-1]), axis=-1)


def derive_seed(seed: int, *keys: int) -> int:
    """A distinct 31-bit sampling seed for ``keys`` under ``seed`` (a request's index in a call; a
    run's step, prompt and sample), stable across processes and resumes."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, *keys]).generate_state(1)[0] >> 1)


def step_keys(base_keys_S: jax.Array, step_S: jax.Array) -> jax.Array:
    """The key for a row's ``step``-th generated token: a pure function of (request seed, step)."""
    return jax.vmap(jax.random.fold_in)(base_keys_S, step_S.astype(jnp.uint32))


def request_key(seed: int) -> jax.Array:
    return jax.random.key(seed)
