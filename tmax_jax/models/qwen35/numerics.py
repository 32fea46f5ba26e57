"""Precision of the float32 matmuls that must stay float32 (delta-rule state, LM head)."""

from __future__ import annotations

import jax


def f32_matmul_precision() -> jax.lax.Precision | None:
    """HIGHEST on accelerators, whose default f32 dot may round inputs (TF32 / bf16 passes).

    On CPU the default f32 dot is already exact float32; asking for HIGHEST there adds nothing and
    was seen to deadlock XLA's CPU thread pool next to LAPACK triangular solves on 2-core machines.
    """
    return None if jax.default_backend() == "cpu" else jax.lax.Precision.HIGHEST
