"""Pallas kernels, each beside its pure-JAX reference and chosen by backend (``kernels`` in the config)."""

from tmax_jax.kernels.dispatch import KERNEL_CHOICES, check_kernels, chunked_gated_delta_rule, resolve_kernels
from tmax_jax.kernels.gated_delta_rule import pallas_chunked_gated_delta_rule

__all__ = [
    "KERNEL_CHOICES",
    "check_kernels",
    "chunked_gated_delta_rule",
    "pallas_chunked_gated_delta_rule",
    "resolve_kernels",
]
