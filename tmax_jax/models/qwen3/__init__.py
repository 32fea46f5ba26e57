"""Qwen3 dense (transformers ``qwen3``) on the Qwen 3.5 decoder: the same model class with
``family="qwen3"`` (plain GQA attention with q/k RMSNorm in every layer, weight-scaled RMSNorms)."""

from tmax_jax.models.qwen3.config import qwen3_config, qwen3_from_hf_config, qwen3_to_hf_config

__all__ = ["qwen3_config", "qwen3_from_hf_config", "qwen3_to_hf_config"]
