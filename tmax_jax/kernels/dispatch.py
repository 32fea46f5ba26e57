"""Which implementation of the chunked gated delta rule runs: ``kernels = auto | jax | pallas``.

- ``jax``: always the pure-JAX path (``tmax_jax.models.qwen35.delta_rule``).
- ``pallas``: the Pallas kernels, Mosaic on TPU, Triton on GPU, interpret mode elsewhere (CPU: slow,
  for tests).
- ``auto``: the kernels on TPU and GPU, the pure-JAX path on CPU.

The backend is read when the call is traced (``jax.default_backend()``), like the JAX path's matmul
precision.
"""

from __future__ import annotations

import jax

from tmax_jax.kernels.gated_delta_rule import pallas_chunked_gated_delta_rule

KERNEL_CHOICES = ("auto", "jax", "pallas")
_ACCELERATORS = ("tpu", "gpu")


def check_kernels(kernels: str) -> str:
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels!r}; expected one of {list(KERNEL_CHOICES)}")
    return kernels


def resolve_kernels(kernels: str, backend: str | None = None) -> tuple[str, str | None, bool]:
    """``(implementation, pallas launcher, interpret)`` for a choice on a backend (default: JAX's)."""
    check_kernels(kernels)
    backend = jax.default_backend() if backend is None else backend
    on_accelerator = backend in _ACCELERATORS
    if kernels == "jax" or (kernels == "auto" and not on_accelerator):
        return "jax", None, False
    # Off an accelerator, interpret the TPU launcher: its one-chunk-per-grid-step form is the cheaper
    # one to interpret.
    return "pallas", backend if on_accelerator else "tpu", not on_accelerator


def chunked_gated_delta_rule(
    q_BxTxHxK: jax.Array,
    k_BxTxHxK: jax.Array,
    v_BxTxHxV: jax.Array,
    g_BxTxH: jax.Array,
    beta_BxTxH: jax.Array,
    initial_state_BxHxKxV: jax.Array | None = None,
    groups_BxT: jax.Array | None = None,
    chunk_size: int = 64,
    *,
    kernels: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """The chunked gated delta rule by ``kernels`` choice; same contract as the pure-JAX function."""
    impl, backend, interpret = resolve_kernels(kernels)
    args = (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, initial_state_BxHxKxV, groups_BxT)
    if impl == "jax":
        # Imported here: the model package imports this module, and the reference lives in it.
        from tmax_jax.models.qwen35.delta_rule import chunked_gated_delta_rule as jax_delta_rule

        return jax_delta_rule(*args, chunk_size=chunk_size)
    return pallas_chunked_gated_delta_rule(*args, chunk_size=chunk_size, backend=backend, interpret=interpret)
