"""Which implementation of the chunked gated delta rule runs: ``kernels = auto | jax | pallas``.

- ``jax``: always the pure-JAX path (``tmax_jax.models.qwen35.delta_rule``).
- ``pallas``: the Pallas kernels, Mosaic on TPU, Triton on GPU, interpret mode elsewhere (CPU: slow,
  for tests).
- ``auto``: the kernels on TPU, the pure-JAX path on GPU and CPU.

On a GPU the Triton kernels failed the device check (``benchmarks/device_check.sh`` on one H200,
jax 0.11.2, 2026-12-04): compiling and running them once on a 2,085-token check did not finish
within 80 s, and a 0.8B or 2B train step through them did not finish within 110 s / 150 s, while
the JAX path ran the 2B step at 8,192 tokens in 1.5 s after a 64 s compile. ``auto`` therefore
keeps GPUs on the JAX path; ``pallas`` still forces the kernels there. On TPU they have been
checked in interpret mode and through Mosaic's lowering only, never on a chip; ``kernels: jax``
(the model config's default) is the known-good choice until device_check passes there.

The backend is the target platform, read when the call is traced (``tmax_jax.target``: the mesh's
devices, not the host's), like the JAX path's matmul precision.

Under a mesh (``jax.set_mesh``) the kernels run inside ``jax.shard_map``: rows split over the batch
axes, value heads over the axis the rules table gives ``lin_v_heads``. The rule is independent per
row and per head, so each device runs the kernels on its own slice; without this, XLA would have to
gather the whole batch onto every device to run a custom call it cannot partition.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tmax_jax.kernels.gated_delta_rule import pallas_chunked_gated_delta_rule
from tmax_jax.target import several_devices, target_platform

KERNEL_CHOICES = ("auto", "jax", "pallas")
_ACCELERATORS = ("tpu", "gpu")
# Backends where ``auto`` picks the kernels (see the module docstring for why GPU is not one).
_AUTO_KERNELS = ("tpu",)


def check_kernels(kernels: str) -> str:
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels!r}; expected one of {list(KERNEL_CHOICES)}")
    return kernels


def resolve_kernels(kernels: str, backend: str | None = None) -> tuple[str, str | None, bool]:
    """``(implementation, pallas launcher, interpret)`` for a choice on a backend (default: JAX's)."""
    check_kernels(kernels)
    backend = target_platform() if backend is None else backend
    on_accelerator = backend in _ACCELERATORS
    if kernels == "jax" or (kernels == "auto" and backend not in _AUTO_KERNELS):
        return "jax", None, False
    # Off an accelerator, interpret the TPU launcher: its one-chunk-per-grid-step form is the cheaper
    # one to interpret.
    return "pallas", backend if on_accelerator else "tpu", not on_accelerator


def _mesh_axes(batch: int, heads: int) -> tuple[tuple[str, ...], str | None]:
    """(mesh axes splitting the rows, mesh axis splitting the heads) for the current mesh; an axis
    that does not divide its dimension is left out (the slice stays whole, as the params' rules do)."""
    from tmax_jax.sharding import BATCH_AXES, DEFAULT_RULES

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    rows = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    if batch % math.prod(sizes[a] for a in rows):
        rows = ()
    head_axis = dict(DEFAULT_RULES).get("lin_v_heads")
    if sizes.get(head_axis, 1) <= 1 or heads % sizes[head_axis]:
        head_axis = None
    return rows, head_axis


def _sharded_pallas(args, **kw):
    q, k, v, g, beta, s0, groups = args
    B, T, H, K = q.shape
    rows, head_axis = _mesh_axes(B, H)
    if not rows and head_axis is None and not several_devices():
        return pallas_chunked_gated_delta_rule(*args, **kw)
    if s0 is None:
        s0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)
    if groups is None:
        groups = jnp.zeros((B, T), jnp.int32)
    b = rows or None
    btd, bt, bhkv = P(b, None, head_axis, None), P(b, None, head_axis), P(b, head_axis, None, None)
    return jax.shard_map(
        lambda *a: pallas_chunked_gated_delta_rule(*a, **kw),
        in_specs=(btd, btd, btd, bt, bt, bhkv, P(b, None)),
        out_specs=(btd, bhkv),
        check_vma=False,  # pallas_call carries no varying-axes annotations
    )(q, k, v, g, beta, s0, groups)


def _kernel_precision(backend: str) -> str:
    """The kernels' float32 matmuls: "high" (Triton TF32x3, tensor cores) on GPU when
    ``TMAX_JAX_F32_DOT`` names a tensor-core algorithm for the JAX path's float32 matmuls, else
    "highest" (Triton's IEEE float32: FMA loops, no tensor cores; Mosaic's fp32 contraction on TPU).
    """
    from tmax_jax.models.qwen35.numerics import f32_dot_setting

    return "high" if backend == "gpu" and f32_dot_setting() != "highest" else "highest"


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
    out_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """The chunked gated delta rule by ``kernels`` choice; same contract as the pure-JAX function."""
    impl, backend, interpret = resolve_kernels(kernels)
    args = (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, initial_state_BxHxKxV, groups_BxT)
    if impl == "jax":
        # Imported here: the model package imports this module, and the reference lives in it.
        from tmax_jax.models.qwen35.delta_rule import chunked_gated_delta_rule as jax_delta_rule

        return jax_delta_rule(*args, chunk_size=chunk_size, out_dtype=out_dtype)
    out, s_final = _sharded_pallas(
        args,
        chunk_size=chunk_size,
        backend=backend,
        interpret=interpret,
        precision=_kernel_precision(backend),
    )
    return (out if out_dtype is None else out.astype(out_dtype)), s_final
