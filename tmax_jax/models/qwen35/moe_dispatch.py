"""Expert parallelism with all-to-all dispatch: each device of the expert mesh axis holds
``E / P`` whole experts, and every (token, chosen expert) row travels to the device that holds its
expert and back, instead of every device gathering every expert's weights.

Per device (inside ``jax.shard_map``): rows are sorted by expert, so the rows bound for each expert
shard are one contiguous run; runs are laid into a ``[P, R, D]`` send buffer (R = local rows, the
worst case of one shard getting them all: dropless, static shapes), ``all_to_all`` over the expert
axis, the received rows go through the local experts' grouped matmuls, ``all_to_all`` back, and each
row returns to its (token, slot) place. Padding rows are zeros (zero output, zero gradient). With the
intermediate axis split over ``tensor`` the down projection gives partial sums, summed at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tmax_jax.models.qwen35.moe import grouped_matmul

f32 = jnp.float32
BATCH_AXES = ("data", "fsdp")


def expert_parallel_ok(mesh, axis: str, num_tokens: int, num_experts: int) -> bool:
    """Whether the ambient ``mesh`` can run the all-to-all path: the axis exists with size > 1,
    divides the experts, and the tokens split evenly over the batch axes."""
    if mesh is None or mesh.empty or axis not in mesh.axis_names or mesh.shape[axis] < 2:
        return False
    batch = 1
    for a in BATCH_AXES:
        batch *= mesh.shape.get(a, 1)
    return num_experts % mesh.shape[axis] == 0 and num_tokens % batch == 0


def _local_experts(x_NxD, experts_NxK, weights_NxK, w_gate_up, w_down, *, axis, dtype, tensor):
    """One device's share: its tokens, its experts' weights ``[E/P, D, 2, I/t]`` / ``[E/P, I/t, D]``."""
    Pn = jax.lax.axis_size(axis)
    N, K = experts_NxK.shape
    E_l, D, _, I = w_gate_up.shape
    R = N * K
    flat_e_R = experts_NxK.reshape(-1)
    order_R = jnp.argsort(flat_e_R, stable=True)
    sorted_e_R = flat_e_R[order_R]
    dest_R = sorted_e_R // E_l  # the expert shard of each sorted row (non-decreasing)
    counts_P = jnp.bincount(dest_R, length=Pn)
    starts_P = jnp.cumsum(counts_P) - counts_P
    # Send buffer: slot (p, j) holds sorted row starts[p] + j when j < counts[p], else zeros.
    j_R = jnp.arange(R)
    idx_PxR = jnp.minimum(starts_P[:, None] + j_R[None, :], R - 1)
    valid_PxR = j_R[None, :] < counts_P[:, None]
    xs_RxD = jnp.take(x_NxD.astype(dtype), order_R // K, axis=0)
    send_x = jnp.where(valid_PxR[..., None], jnp.take(xs_RxD, idx_PxR, axis=0), 0).astype(dtype)
    send_e = jnp.where(valid_PxR, jnp.take(sorted_e_R % E_l, idx_PxR), E_l - 1).astype(jnp.int32)

    recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=True).reshape(Pn * R, D)
    recv_e = jax.lax.all_to_all(send_e, axis, 0, 0, tiled=True).reshape(Pn * R)
    # Padding rows are zeros in the last local group: zero output and no weight gradient.
    order2 = jnp.argsort(recv_e, stable=True)
    group_sizes = jnp.bincount(recv_e, length=E_l).astype(jnp.int32)
    h_x = jnp.take(recv_x, order2, axis=0)
    gate_up = grouped_matmul(h_x, w_gate_up.reshape(E_l, D, 2 * I), group_sizes, dtype)
    h = jax.nn.silu(gate_up[:, :I]) * gate_up[:, I:]
    out = grouped_matmul(h, w_down, group_sizes, dtype)
    out_recv = jnp.take(out, jnp.argsort(order2), axis=0).reshape(Pn, R, D)

    back = jax.lax.all_to_all(out_recv, axis, 0, 0, tiled=True).reshape(Pn * R, D)
    out_sorted_RxD = jnp.take(back, dest_R * R + (j_R - starts_P[dest_R]), axis=0)
    out_NxKxD = jnp.take(out_sorted_RxD, jnp.argsort(order_R), axis=0).reshape(N, K, D)
    y_NxD = jnp.einsum("nkd,nk->nd", out_NxKxD, weights_NxK.astype(dtype), preferred_element_type=f32)
    if tensor:
        y_NxD = jax.lax.psum(y_NxD, "tensor")
    return y_NxD.astype(dtype)


def expert_parallel_experts(
    x_NxD, experts_NxK, weights_NxK, w_gate_up_ExDx2xI, w_down_ExIxD, *, dtype, axis: str = "fsdp"
):
    """``grouped_experts`` with the experts split over the ambient mesh's ``axis`` and the rows
    dispatched by all-to-all (see the module docstring); tokens split over the batch axes."""
    mesh = jax.sharding.get_abstract_mesh()
    I = w_gate_up_ExDx2xI.shape[-1]
    tensor = "tensor" in mesh.axis_names and mesh.shape["tensor"] > 1 and I % mesh.shape["tensor"] == 0
    t = "tensor" if tensor else None
    batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    rows = P(batch, None)

    def local(x, e, w, gu, dn):
        return _local_experts(x, e, w, gu, dn, axis=axis, dtype=dtype, tensor=tensor)

    return jax.shard_map(
        local,
        in_specs=(rows, rows, rows, P(axis, None, None, t), P(axis, t, None)),
        out_specs=rows,
    )(x_NxD, experts_NxK, weights_NxK, w_gate_up_ExDx2xI, w_down_ExIxD)
