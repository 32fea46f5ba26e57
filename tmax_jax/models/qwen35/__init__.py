"""Pure-JAX Qwen 3.5 text decoder (Gated DeltaNet + gated attention) with a float32 LM head."""

from tmax_jax.models.qwen35.cache import Qwen35Cache
from tmax_jax.models.qwen35.config import PRESETS, Qwen35Config
from tmax_jax.models.qwen35.model import Qwen35ForCausalLM

__all__ = ["PRESETS", "Qwen35Cache", "Qwen35Config", "Qwen35ForCausalLM"]
