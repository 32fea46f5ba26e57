"""Qwen 3.5 sparse MoE block: softmax router, top-k experts run dropless with grouped matmuls, and a
shared SwiGLU expert behind a sigmoid gate.

Every (token, chosen expert) pair is one row; rows are sorted by expert and each expert's contiguous
group runs through ``jax.lax.ragged_dot``: no capacity factor, no dropped token, and the compute is
the routed work only (``tokens * top_k`` rows), not ``tokens * num_experts``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tmax_jax.models.qwen35.config import Qwen35Config
from tmax_jax.models.qwen35.mlp import SwiGLU
from tmax_jax.models.qwen35.params import make_param, normal

f32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """Per-expert sums over the valid tokens of one or more MoE layers (float32 ``[..., E]``).

    ``tokens``: how many (token, top-k slot) assignments went to each expert; ``probs``: the sum of
    each expert's full softmax probability; ``count``: valid tokens seen (per layer).
    """

    tokens: jax.Array
    probs: jax.Array
    count: jax.Array

    def load(self) -> jax.Array:
        """Each expert's share of the routed assignments (sums to 1 over experts, per layer)."""
        return self.tokens / jnp.maximum(self.tokens.sum(-1, keepdims=True), 1.0)

    def metrics(self, prefix: str = "router/") -> dict[str, jax.Array]:
        """Scalar load metrics, each the mean over layers of a per-layer value: the busiest and the
        idlest expert's share times E (1.0 when balanced), the share's entropy over log E (1.0 when
        balanced, 0 when one expert takes everything), the fraction of experts that got no token,
        and the load-balancing loss (unscaled; top_k at uniform routing)."""
        E = self.tokens.shape[-1]
        load = self.load().reshape(-1, E)
        entropy = -jnp.sum(jnp.where(load > 0, load * jnp.log(jnp.maximum(load, 1e-30)), 0.0), -1)
        return {
            f"{prefix}max_load": jnp.mean(jnp.max(load, -1)) * E,
            f"{prefix}min_load": jnp.mean(jnp.min(load, -1)) * E,
            f"{prefix}load_entropy": jnp.mean(entropy) / jnp.log(float(E)),
            f"{prefix}idle_experts": jnp.mean((self.tokens.reshape(-1, E) == 0).astype(f32)),
            f"{prefix}aux_loss": self.aux_loss(),
        }

    def aux_loss(self) -> jax.Array:
        """Switch-style load-balancing loss, as transformers' ``load_balancing_loss_func`` over the
        layers summed here: ``E * sum_e f_e * p_e`` with f = assignments per token, p = mean
        probability (1.0 at the top-k's ideal uniform routing, scaled by top_k)."""
        tokens = self.tokens.reshape(-1, self.tokens.shape[-1]).sum(0)
        probs = self.probs.reshape(-1, self.probs.shape[-1]).sum(0)
        rows = jnp.maximum(jnp.sum(self.count), 1.0)
        return self.tokens.shape[-1] * jnp.sum((tokens / rows) * (probs / rows))


def route(
    logits_NxE: jax.Array, top_k: int, normalize: bool, replay_NxK: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(float32 softmax probs ``[N, E]``, top-k weights ``[N, K]`` float32, expert ids ``[N, K]``).

    ``replay_NxK`` (routing replay): expert ids to use instead of the router's own top-k, for every
    token whose first id is >= 0 (others are routed as usual). The weights are still this router's
    probabilities at those ids (renormalised as configured), so gradients reach the router.
    """
    probs_NxE = jax.nn.softmax(logits_NxE.astype(f32), axis=-1)
    _, experts_NxK = jax.lax.top_k(probs_NxE, top_k)
    if replay_NxK is not None:
        if replay_NxK.shape != experts_NxK.shape:
            raise ValueError(f"replayed expert ids {replay_NxK.shape} != routed {experts_NxK.shape}")
        replay_NxK = replay_NxK.astype(experts_NxK.dtype)
        experts_NxK = jnp.where(replay_NxK[:, :1] >= 0, replay_NxK, experts_NxK)
    weights_NxK = jnp.take_along_axis(probs_NxE, experts_NxK, axis=-1)
    if normalize:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return probs_NxE, weights_NxK, experts_NxK


# x^T @ dy summed within each group: [R, D] x [R, O] -> [G, D, O] (the weights' gradient).
_GROUPED_WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(x_RxD, w_GxDxO, group_sizes_G, dtype):
    """``x[r] @ w[g(r)]`` for rows sorted by group, in ``dtype`` with float32 accumulation.

    The weights (any dtype, e.g. float32 params) are cast to ``dtype`` here; their gradient is
    summed over each group's rows in float32 and returned in the weights' own dtype, so a bfloat16
    compute step never rounds a weight gradient to bfloat16. Autodiff of ``ragged_dot`` would
    accumulate in the compute dtype (and mix float32 cotangents into the grouped matmuls)."""
    return _grouped_matmul_fwd(x_RxD, w_GxDxO, group_sizes_G, dtype)[0]


def _grouped_matmul_fwd(x_RxD, w_GxDxO, group_sizes_G, dtype):
    y_RxO = jax.lax.ragged_dot(
        x_RxD.astype(dtype), w_GxDxO.astype(dtype), group_sizes_G, preferred_element_type=f32
    )
    return y_RxO.astype(dtype), (x_RxD, w_GxDxO, group_sizes_G)


def _varying(x) -> frozenset:
    """The shard_map axes ``x`` varies over (empty outside shard_map)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def _grouped_matmul_bwd(dtype, res, dy_RxO):
    x_RxD, w_GxDxO, group_sizes_G = res
    dy_RxO = dy_RxO.astype(dtype)
    w_GxOxD = jnp.swapaxes(w_GxDxO.astype(dtype), 1, 2)
    dx_RxD = jax.lax.ragged_dot(dy_RxO, w_GxOxD, group_sizes_G, preferred_element_type=f32)
    dw_GxDxO = jax.lax.ragged_dot_general(
        x_RxD.astype(dtype), dy_RxO, group_sizes_G, _GROUPED_WEIGHT_GRAD, preferred_element_type=f32
    )
    # Inside shard_map an input's gradient may vary over axes the input does not: the weights'
    # over the data-parallel replicas of the experts, the rows' over a tensor-split intermediate
    # axis (partial sums). It is summed over those axes.
    return _sum_to(dx_RxD, x_RxD), _sum_to(dw_GxDxO, w_GxDxO), None


def _sum_to(grad, primal):
    extra = tuple(sorted(_varying(grad) - _varying(primal)))
    if extra:
        grad = jax.lax.psum(grad, extra)
    return grad.astype(primal.dtype)


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_experts(x_NxD, experts_NxK, weights_NxK, w_gate_up_ExDx2xI, w_down_ExIxD, dtype=None):
    """``sum_k weights[n, k] * SwiGLU_{experts[n, k]}(x[n])`` with grouped (ragged) matmuls.

    ``dtype`` (default ``x``'s): the compute dtype; the weights may be float32 params (cast inside
    the grouped matmuls). Matmuls and the sum over the top-k slots accumulate in float32."""
    dt = x_NxD.dtype if dtype is None else jnp.dtype(dtype)
    N, K = experts_NxK.shape
    E, D, _, I = w_gate_up_ExDx2xI.shape
    flat_e_R = experts_NxK.reshape(-1)  # R = N * K rows, row r = (token r // K, slot r % K)
    order_R = jnp.argsort(flat_e_R, stable=True)
    group_sizes_E = jnp.bincount(flat_e_R, length=E).astype(jnp.int32)
    xs_RxD = jnp.take(x_NxD.astype(dt), order_R // K, axis=0)
    gate_up_Rx2I = grouped_matmul(xs_RxD, w_gate_up_ExDx2xI.reshape(E, D, 2 * I), group_sizes_E, dt)
    gate_RxI, up_RxI = gate_up_Rx2I[:, :I], gate_up_Rx2I[:, I:]
    out_RxD = grouped_matmul(jax.nn.silu(gate_RxI) * up_RxI, w_down_ExIxD, group_sizes_E, dt)
    # Back to (token, slot) order through the inverse permutation: a gather, no scatter-add.
    inverse_R = jnp.argsort(order_R)
    out_NxKxD = jnp.take(out_RxD, inverse_R, axis=0).reshape(N, K, -1)
    y_NxD = jnp.einsum("nkd,nk->nd", out_NxKxD, weights_NxK.astype(dt), preferred_element_type=f32)
    return y_NxD.astype(dt)


class SparseMoeBlock(nnx.Module):
    def __init__(self, cfg: Qwen35Config, *, dtype, param_dtype, rngs: nnx.Rngs, stack: int | None = None):
        D, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        init = normal(cfg.initializer_range)
        self.dtype = dtype
        self.top_k = cfg.num_experts_per_tok
        # Mesh axis the experts are split over for all-to-all dispatch (None: XLA partitions the
        # grouped matmul from the weights' sharding, gathering experts as FSDP gathers weights).
        self.expert_axis: str | None = None
        self.normalize = cfg.norm_topk_prob
        self.router = make_param(rngs, init, (D, E), ("embed", "expert_logits"), param_dtype, stack)
        # Gate and up projections of each expert side by side ([..., 0, :] gate, [..., 1, :] up): one
        # grouped matmul for both, and the intermediate axis stays whole for tensor sharding.
        self.gate_up_proj = make_param(
            rngs, init, (E, D, 2, I), ("expert", "embed", None, "mlp"), param_dtype, stack
        )
        self.down_proj = make_param(rngs, init, (E, I, D), ("expert", "mlp", "embed"), param_dtype, stack)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = SwiGLU(
                cfg,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
                stack=stack,
                intermediate_size=cfg.shared_expert_intermediate_size,
            )
            self.shared_expert_gate = make_param(rngs, init, (D,), ("embed",), param_dtype, stack)

    def _experts(self, x_NxD, experts_NxK, weights_NxK, dt):
        """The routed experts' output: all-to-all dispatch over ``expert_axis`` when it is set and
        the ambient mesh allows it (``moe_dispatch``), else one grouped matmul over all experts
        (under a mesh, XLA partitions it from the weights' sharding)."""
        w_gu, w_dn = self.gate_up_proj[...], self.down_proj[...]
        if self.expert_axis is not None:
            from tmax_jax.models.qwen35 import moe_dispatch as ep

            mesh = jax.sharding.get_abstract_mesh()
            if ep.expert_parallel_ok(mesh, self.expert_axis, x_NxD.shape[0], w_gu.shape[0]):
                return ep.expert_parallel_experts(
                    x_NxD, experts_NxK, weights_NxK, w_gu, w_dn, dtype=dt, axis=self.expert_axis
                )
        return grouped_experts(x_NxD, experts_NxK, weights_NxK, w_gu, w_dn, dtype=dt)

    def __call__(
        self, x_BxTxD: jax.Array, valid_BxT: jax.Array | None = None, replay_BxTxK: jax.Array | None = None
    ) -> tuple[jax.Array, RouterStats, jax.Array]:
        """(output ``[B, T, D]``, router sums over the valid tokens, the expert ids used ``[B, T, K]``
        int32). ``replay_BxTxK``: routing replay (see ``route``)."""
        dt = self.dtype
        B, T, D = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(B * T, D)
        logits_NxE = jnp.einsum("nd,de->ne", x_NxD, self.router[...].astype(dt))
        replay_NxK = None if replay_BxTxK is None else replay_BxTxK.reshape(B * T, -1)
        probs_NxE, weights_NxK, experts_NxK = route(logits_NxE, self.top_k, self.normalize, replay_NxK)
        # transformers rounds the renormalised weights to the activations' dtype before use.
        weights_NxK = weights_NxK.astype(dt)
        y_NxD = self._experts(x_NxD, experts_NxK, weights_NxK, dt)
        y_BxTxD = y_NxD.reshape(B, T, D)
        if self.has_shared:
            gate_BxT = jnp.einsum("btd,d->bt", x_BxTxD, self.shared_expert_gate[...].astype(dt))
            y_BxTxD = y_BxTxD + jax.nn.sigmoid(gate_BxT)[..., None] * self.shared_expert(x_BxTxD)

        valid_N = jnp.ones((B * T,), f32) if valid_BxT is None else valid_BxT.reshape(-1).astype(f32)
        E = probs_NxE.shape[-1]
        hits_E = jnp.zeros((E,), f32).at[experts_NxK.reshape(-1)].add(jnp.repeat(valid_N, self.top_k))
        stats = RouterStats(
            tokens=jax.lax.stop_gradient(hits_E),
            probs=jnp.einsum("ne,n->e", probs_NxE, valid_N),
            count=jnp.sum(valid_N),
        )
        return y_BxTxD, stats, experts_NxK.reshape(B, T, self.top_k).astype(jnp.int32)
