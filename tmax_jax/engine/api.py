"""``generate(model, prompts, ...)``: batch generation through the engine in one call."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from tmax_jax.engine.engine import Engine, _next_pow2
from tmax_jax.engine.orchestrator import Completion, Orchestrator, Request
from tmax_jax.engine.sampling import SamplingParams, derive_seed
from tmax_jax.errors import ConfigError

# One engine per (model, shape) so repeated calls reuse compiled steps; weights are re-read each call.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def speculative_settings(
    checkpoint: Any, tokens: int, *, setting: str = "speculative_tokens", **load_kw
) -> dict:
    """``Engine`` keyword arguments for ``tokens`` drafted tokens per decode step with the
    multi-token-prediction module of ``checkpoint`` ({} for 0). ``load_kw`` go to ``load_mtp``
    (dtype, param_dtype, mesh, rules); ``setting`` is the option named in errors."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ConfigError(f"{setting} must be an integer >= 0, got {tokens!r}")
    if not tokens:
        return {}
    from tmax_jax.checkpoints import load_mtp

    mtp = load_mtp(checkpoint, **load_kw)
    if mtp is None:
        raise ConfigError(
            f"{setting}={tokens} drafts with the checkpoint's multi-token-prediction module, but "
            f"{checkpoint} holds no mtp.* tensors (set it to 0, or use a checkpoint that has them)"
        )
    return {"mtp": mtp, "speculative_tokens": tokens}


def model_eos_ids(model: Any) -> tuple[int, ...]:
    """eos token ids from the model's config (``config`` or ``cfg``), as a tuple (may be empty)."""
    for name in ("config", "cfg"):
        cfg = getattr(model, name, None)
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ()


def _engine_for(
    model: Any, slots: int, max_len: int, max_prefill: int, cache_dtype: Any, mtp: Any = None, k: int = 0
) -> Engine:
    per_model = _ENGINES.setdefault(model, {})
    # The MTP module itself is in the key (an id could be reused by a later module).
    key = (slots, max_len, max_prefill, jnp.dtype(cache_dtype).name, k, mtp if k else None)
    engine = per_model.get(key)
    if engine is None:
        engine = Engine(
            model,
            max_concurrent_decodes=slots,
            max_cache_length=max_len,
            max_prefill_length=max_prefill,
            cache_dtype=cache_dtype,
            mtp=mtp,
            speculative_tokens=k,
        )
        per_model[key] = engine
    else:
        engine.update_params(model)
    return engine


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    max_concurrent: int = 32,
    cache_dtype: Any = jnp.float32,
    mtp: Any = None,
    speculative_tokens: int = 0,
) -> list[Completion]:
    """Generate for every prompt (token id lists) with continuous batching.

    Each output has ``tokens`` (ending with eos, included, or after ``max_new_tokens``) and
    ``logprobs`` (float32 log-softmax(logits / T) of each token; plain logits when T == 0).
    ``eos_token_id`` defaults to the model config's. Prompt ``i`` samples with its own key derived
    from ``(seed, i)``, so results do not depend on batching. ``mtp`` and ``speculative_tokens``:
    speculative decoding (``Engine``); the tokens are the same.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    prompts = [list(p) for p in prompts]
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ConfigError("generate: every prompt needs at least one token")
    eos = model_eos_ids(model) if eos_token_id is None else eos_token_id
    eos = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    longest = max(len(p) for p in prompts)
    # Round shapes up so calls with similar sizes share one engine (and its compiled steps).
    max_len = max(64, _next_pow2(longest + max_new_tokens + 1))
    max_prefill = min(512, max(16, _next_pow2(longest)))
    slots = min(_next_pow2(len(prompts)), _next_pow2(max_concurrent))
    engine = _engine_for(model, slots, max_len, max_prefill, cache_dtype, mtp, speculative_tokens)
    requests = [
        Request(
            prompt=p,
            max_tokens=max_new_tokens,
            sampling=SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, seed=derive_seed(seed, i)
            ),
            stop_token_ids=eos,
        )
        for i, p in enumerate(prompts)
    ]
    with Orchestrator(engine) as orch:
        return orch.generate(requests)
