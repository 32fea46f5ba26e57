"""Qwen3 dense configs: transformers' ``Qwen3Config`` fields <-> a ``Qwen35Config`` of family "qwen3".

Qwen3 shares the Qwen 3.5 decoder's pieces (GQA attention with per-head q/k RMSNorm, RoPE, SwiGLU,
the float32 head); it differs in having no attention output gate, RoPE over the whole head, RMSNorm
weights that scale by ``w`` (stored around 1) and full attention in every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tmax_jax.errors import ConfigError
from tmax_jax.models.qwen35.config import FULL, QWEN3, QWEN3_MODEL_TYPE, Qwen35Config


def qwen3_config(**fields: Any) -> Qwen35Config:
    """A Qwen3 dense config; ``fields`` are Qwen35Config fields (head_dim, rope_theta, ...)."""
    fields.setdefault("partial_rotary_factor", 1.0)
    fields.setdefault("rope_theta", 1_000_000.0)
    return Qwen35Config(family=QWEN3, **fields)


def qwen3_from_hf_config(d: Mapping[str, Any]) -> Qwen35Config:
    """From a ``qwen3`` config.json dict (or ``Qwen3Config.to_dict()``)."""
    if d.get("model_type", QWEN3_MODEL_TYPE) != QWEN3_MODEL_TYPE:
        raise ConfigError(f"model_type {d.get('model_type')!r} is not {QWEN3_MODEL_TYPE!r}")
    if d.get("use_sliding_window"):
        raise ConfigError("Qwen3 use_sliding_window=True is not supported (full attention only)")
    if d.get("attention_bias"):
        raise ConfigError("Qwen3 attention_bias=True is not supported")
    rope = dict(d.get("rope_parameters") or {})
    rope.update(d.get("rope_scaling") or {})  # the older layout keeps theta at the top level
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default' and 'yarn')")
    yarn = {}
    if rope_type == "yarn":
        extra = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if rope.get(k) is not None]
        extra += [
            f"{k}={rope[k]}" for k, dflt in (("beta_fast", 32), ("beta_slow", 1)) if rope.get(k, dflt) != dflt
        ]
        if rope.get("truncate", True) is not True:
            extra.append("truncate=False")
        if extra:
            raise ConfigError(
                f"YaRN rope_scaling with {extra} is not supported (factor and the defaults only)"
            )
        yarn = dict(
            yarn_factor=float(rope["factor"]),
            yarn_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    layer_types = tuple(d.get("layer_types") or ())
    bad = sorted({t for t in layer_types if t != FULL})
    if bad:
        raise ConfigError(f"Qwen3 layer_types {bad} are not supported (only {FULL!r})")
    n_layers = int(d["num_hidden_layers"])
    heads = int(d["num_attention_heads"])
    kw: dict[str, Any] = dict(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        layer_types=(FULL,) * n_layers,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10_000.0))),
        partial_rotary_factor=1.0,
        max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        hidden_act=d.get("hidden_act", "silu"),
        initializer_range=float(d.get("initializer_range", 0.02)),
        **yarn,
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = d.get(key)
        kw[key] = (v[0] if v else None) if isinstance(v, list) else v
    return Qwen35Config(family=QWEN3, **kw)


def qwen3_to_hf_config(cfg: Qwen35Config) -> dict[str, Any]:
    """A config.json dict for transformers' Qwen3ForCausalLM."""
    if cfg.family != QWEN3:
        raise ConfigError(f"family={cfg.family!r} is not {QWEN3!r}")
    if cfg.rotary_dim != cfg.head_dim:
        raise ConfigError(f"Qwen3 rotates the whole head: partial_rotary_factor={cfg.partial_rotary_factor}")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": QWEN3_MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "layer_types": list(cfg.layer_types),
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.yarn is None
        else {
            "rope_type": "yarn",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.yarn_factor,
            "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
        },
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "hidden_act": cfg.hidden_act,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "use_cache": True,
    }


__all__ = ["qwen3_config", "qwen3_from_hf_config", "qwen3_to_hf_config"]
