"""Hugging Face checkpoints in and out: ``load_hf`` (streaming, shard-aware) and ``save_hf``."""

from tmax_jax.checkpoints.load import load_hf, load_mtp, read_hf_config
from tmax_jax.checkpoints.save import save_hf

__all__ = ["load_hf", "load_mtp", "read_hf_config", "save_hf"]
