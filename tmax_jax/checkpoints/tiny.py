"""A random tiny Qwen 3.5 checkpoint with a locally trained tokenizer, so everything runs offline."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tmax_jax.models.qwen35 import Qwen35Config


def write_tiny_checkpoint(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    corpus: list[str] | None = None,
    base: Qwen35Config | None = None,
):
    """Writes OUT_DIR/{config.json, model.safetensors, tokenizer files}; returns (path, model).

    ``corpus`` is the text the byte-level BPE is trained on (default: a small built-in shell corpus);
    the model's vocabulary and special token ids are the tokenizer's, the rest of the shape is
    ``base`` (default: the "tiny" preset).
    """
    from flax import nnx

    from tmax_jax.checkpoints.save import save_hf
    from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
    from tmax_jax.tokenizer import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(out_dir, vocab_size=vocab_size, corpus=corpus)
    ids = tokenizer.convert_tokens_to_ids
    cfg = dataclasses.replace(
        base or Qwen35Config.preset("tiny"),
        vocab_size=max(vocab_size, len(tokenizer)),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
        bos_token_id=None,
    )
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(seed))
    return save_hf(model, out_dir, tokenizer=tokenizer), model
