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


def make_torch_mtp(config_dict: dict[str, Any], *, num_layers: int = 1, seed: int = 0):
    """A reference multi-token-prediction module built from transformers' own Qwen 3.5 layers (a
    full-attention ``Qwen3_5DecoderLayer``, ``Qwen3_5RMSNorm``, the text rotary embedding), composed
    as published checkpoints' ``mtp.*`` tensors are used: ``fc([norm_e(embed(next)), norm_h(hidden)])``,
    the layers, a final norm. Random, perturbed, float32. ``forward(embed_weight, hidden, next_ids)``
    runs one causal sequence per row from position 0; ``mtp_state_dict()`` names its tensors as a
    checkpoint does (``mtp.``...)."""
    import torch
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(**config_dict)
    cfg._attn_implementation = "eager"
    full = cfg.layer_types.index("full_attention")
    D = cfg.hidden_size

    class TorchMTP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2 * D, D, bias=False)
            self.pre_fc_norm_embedding = m.Qwen3_5RMSNorm(D, eps=cfg.rms_norm_eps)
            self.pre_fc_norm_hidden = m.Qwen3_5RMSNorm(D, eps=cfg.rms_norm_eps)
            self.layers = torch.nn.ModuleList(m.Qwen3_5DecoderLayer(cfg, full) for _ in range(num_layers))
            self.norm = m.Qwen3_5RMSNorm(D, eps=cfg.rms_norm_eps)
            self.rotary = m.Qwen3_5TextRotaryEmbedding(cfg)

        def forward(self, embed_weight, hidden, next_ids):
            e = torch.nn.functional.embedding(next_ids, embed_weight)
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], dim=-1))
            B, T = next_ids.shape
            pos = torch.arange(T)[None].expand(B, T)
            pe = self.rotary(x, pos[None].expand(3, B, T))
            mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
            for layer in self.layers:
                x = layer(x, position_embeddings=pe, attention_mask=mask, position_ids=pos)
            return self.norm(x)

        def mtp_state_dict(self):
            return {f"mtp.{k}": v.detach().clone().contiguous() for k, v in self.named_parameters()}

    model = TorchMTP()
    perturb_(model, seed)
    return model.float().eval()


def add_mtp_to_checkpoint(path: str | Path, *, num_layers: int = 1, seed: int = 0):
    """Writes a random MTP module's tensors (``make_torch_mtp``) into checkpoint ``path`` as
    ``mtp.safetensors``; returns the torch module."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(path) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    keys = set(TINY_TEXT_CONFIG) | {"layer_types"}
    mtp = make_torch_mtp({k: v for k, v in text.items() if k in keys}, num_layers=num_layers, seed=seed)
    save_file(mtp.mtp_state_dict(), str(Path(path) / "mtp.safetensors"))
    return mtp
