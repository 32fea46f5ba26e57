"""Shared test helpers: tiny random transformers Qwen 3.5 checkpoints and a locally trained tokenizer.

    path = make_tiny_hf_checkpoint(tmp_path, num_hidden_layers=4, tie_word_embeddings=False)
    ref = hf_logits(path, ids)                       # transformers' PyTorch logits, float32 numpy
    tok = train_tiny_tokenizer(tmp_path / "tok")     # byte-level BPE + Qwen-style chat template

Every weight is perturbed away from its init (norm weights included) so that parity tests cannot pass
by accident on zeros/ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

TINY_TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def tiny_text_config(**overrides: Any) -> dict[str, Any]:
    cfg = dict(TINY_TEXT_CONFIG)
    cfg.update(overrides)
    return cfg


def perturb_(model, seed: int = 0, scale: float = 0.05) -> None:
    """Moves every parameter away from its init, in place (norm weights: zero-centred and gated)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log") or name.endswith("dt_bias"):
                p.add_(0.3 * noise)
            elif p.ndim == 1:  # RMSNorm weights (zero-centred or not)
                p.add_(0.2 * noise)
            else:
                p.add_(scale * noise * max(float(p.float().std()), 0.02))


def make_tiny_hf_model(*, layout: str = "text", seed: int = 0, perturb: bool = True, **overrides: Any):
    """A random transformers Qwen 3.5 (``Qwen3_5ForCausalLM`` or, layout="vlm", the published
    ``Qwen3_5ForConditionalGeneration`` with a tiny vision tower), float32, eval mode."""
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    torch.manual_seed(seed)
    text = tiny_text_config(**overrides)
    if layout == "text":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    elif layout == "vlm":
        vision = dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"]
        )
        cfg = Qwen3_5Config(
            text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"]
        )
        model = Qwen3_5ForConditionalGeneration(cfg)
    else:
        raise ValueError(f"layout must be 'text' or 'vlm', got {layout!r}")
    if perturb:
        perturb_(model, seed)
    return model.float().eval()


def make_tiny_hf_checkpoint(
    tmp_path: str | Path,
    *,
    layout: str = "text",
    seed: int = 0,
    perturb: bool = True,
    tokenizer: bool = False,
    name: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Saves a tiny random transformers Qwen 3.5 to ``tmp_path/<name>`` and returns that directory."""
    model = make_tiny_hf_model(layout=layout, seed=seed, perturb=perturb, **config_overrides)
    out = Path(tmp_path) / (name or f"qwen35-{layout}-{seed}")
    model.save_pretrained(str(out))
    if tokenizer:
        train_tiny_tokenizer(
            out, vocab_size=config_overrides.get("vocab_size", TINY_TEXT_CONFIG["vocab_size"])
        )
    return out


def load_hf_torch(path: str | Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("model_type") == "qwen3_5":
        model = Qwen3_5ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), config=AutoConfig.from_pretrained(str(path)), dtype=torch.float32
        )
    return model.eval()


def hf_logits(model_or_path, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """transformers' float32 logits ``[B, T, V]`` for int ids ``[B, T]``."""
    import torch

    model = load_hf_torch(model_or_path) if isinstance(model_or_path, (str, Path)) else model_or_path
    ids = torch.as_tensor(np.array(input_ids), dtype=torch.long)
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.as_tensor(np.array(attention_mask), dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits.float().numpy()


def train_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512):
    """A byte-level BPE with Qwen-style special tokens and chat template, saved to ``out_dir``."""
    from tmax_jax.tokenizer import train_tiny_tokenizer as train

    return train(out_dir, vocab_size=vocab_size)


def random_ids(rng: np.random.Generator, batch: int, length: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=(batch, length), dtype=np.int32)
