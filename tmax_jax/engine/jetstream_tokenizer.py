"""The tokenizer face JetStream's orchestrator expects (``encode`` with padding, ``decode``,
``pad_id``/``eos_id``/``bos_id``/``stop_tokens``), over a transformers tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np

from tmax_jax.engine.engine import _next_pow2
from tmax_jax.errors import ConfigError


class JetStreamTokenizer:
    """What ``Engine.build_tokenizer(engine.get_tokenizer())`` returns for JetStream's driver."""

    def __init__(self, tokenizer: Any, *, stop_tokens: set[int] | None = None):
        if tokenizer is None:
            raise ConfigError("JetStreamTokenizer needs a tokenizer; give one to the Engine")
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        pad = getattr(tokenizer, "pad_token_id", None)
        bos = getattr(tokenizer, "bos_token_id", None)
        self.eos_id = int(eos) if eos is not None else -1
        self.pad_id = int(pad) if pad is not None else max(self.eos_id, 0)
        self.bos_id = int(bos) if bos is not None else -1
        self.stop_tokens = set(stop_tokens) if stop_tokens is not None else ({self.eos_id} - {-1})

    def pad(self, ids: list[int], *, is_bos: bool = True, max_prefill_length: int | None = None,
            jax_padding: bool = True) -> tuple[np.ndarray, int]:  # fmt: skip
        """Right-pad ``ids`` (after a bos token when asked and the tokenizer has one) to a power of two."""
        ids = ([self.bos_id] if is_bos and self.bos_id >= 0 else []) + [int(t) for t in ids]
        if max_prefill_length is not None and len(ids) > max_prefill_length:
            ids = ids[-max_prefill_length:]  # JetStream keeps the most recent tokens
        true_length = len(ids)
        width = _next_pow2(true_length)
        if max_prefill_length is not None:
            width = min(width, max_prefill_length)
        out = np.full((width,), self.pad_id, np.int32)
        out[:true_length] = ids
        return out, true_length

    def encode(self, s: str, is_bos: bool = True, prefill_lengths: Any = None,
               max_prefill_length: int | None = None, jax_padding: bool = True, **kwargs) -> tuple[np.ndarray, int]:  # fmt: skip
        ids = self.tokenizer.encode(s, add_special_tokens=False)
        return self.pad(ids, is_bos=is_bos, max_prefill_length=max_prefill_length, jax_padding=jax_padding)

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=False)
