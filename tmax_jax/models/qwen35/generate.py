"""A small greedy / temperature sampler over the cache API, for quick looks (`tmax-jax generate`).

The rollout engine has the real batched, continuously-batched sampler; this one decodes one prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _bucket(n: int, minimum: int = 16) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


# Module-level so repeated calls with the same model structure and shapes reuse the compilation.
@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, state, ids_1xT, seg_1xT, cache, last):
    logits, cache = nnx.merge(graphdef, state)(ids_1xT, segment_ids=seg_1xT, cache=cache)
    return logits[0, last], cache


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, tok_1x1, cache):
    logits, cache = nnx.merge(graphdef, state)(tok_1x1, cache=cache)
    return logits[0, -1], cache


def generate(
    model,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    eos_ids: Iterable[int] = (),
    cache_dtype=None,
) -> list[int]:
    """Returns the generated token ids (without the prompt), stopping after an eos id."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    n = len(prompt_ids)
    prefill_len = _bucket(n)
    cache = model.init_cache(1, prefill_len + max_new_tokens, dtype=cache_dtype)
    ids = np.zeros((1, prefill_len), np.int32)
    ids[0, :n] = prompt_ids
    seg = (np.arange(prefill_len) < n).astype(np.int32)[None]
    graphdef, state = nnx.split(model)

    def pick(logits_V, key):
        if temperature <= 0:
            return int(jnp.argmax(logits_V))
        return int(jax.random.categorical(key, logits_V / temperature))

    eos = set(eos_ids)
    key = jax.random.key(seed)
    logits, cache = _prefill(graphdef, state, jnp.asarray(ids), jnp.asarray(seg), cache, jnp.int32(n - 1))
    out: list[int] = []
    for _ in range(max_new_tokens):
        key, sub = jax.random.split(key)
        tok = pick(logits, sub)
        out.append(tok)
        if tok in eos:
            break
        logits, cache = _step(graphdef, state, jnp.array([[tok]], jnp.int32), cache)
    return out
