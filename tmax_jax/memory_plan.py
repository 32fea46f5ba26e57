"""Per-device memory of a training run, from shapes only (``nnx.eval_shape`` / traced residuals).

Nothing is allocated, so a laptop can tell whether Qwen 3.5 9B at 64K tokens fits a v5p-64 or an
8x H200 host before either is rented. Parameters, gradients and AdamW moments are exact for the given
mesh and rules. Activations come from ``saved_residuals`` of the real train loss traced at the
per-device micro-batch: *resident* is what the backward pass keeps for the whole model (with the
configured remat), *transient* is what one rematerialised piece holds while its backward runs (with
``remat="full"``: a period's layer inputs (two per layer: the mixer half's and the MLP half's) plus
the largest single layer's internals; with ``"layers"`` every layer's inputs are resident and the
transient is the largest layer's internals; otherwise one
layer-pattern period's internals) plus the float32 LM-head chunk buffers.

The trace runs without a mesh, so it sees whole rows; the mesh's splits of activations are applied
here. With the rules' ``sequence`` axis (``tensor``, sharding.py) the residual stream is split by
tokens over it, and tensor parallelism splits the mixers' and MLP's internals by heads over the same
axis: the part of each activation total that grows with the row (measured by tracing at twice the
length) is divided by the axis size, except for what stays whole on every device: the all-gathered
inputs of a layer's projections and the final hidden states the LM head reads. When a head count
does not divide the axis (the rules then leave those heads whole) the internals are not divided,
and activations are an upper bound, as they are with the sequence rule off and ``mesh.tensor`` > 1.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tmax_jax import sharding as shd
from tmax_jax.errors import ConfigError
from tmax_jax.rl.optim import make_optimizer
from tmax_jax.train.config import TrainConfig

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    mesh_shape: dict[str, int]
    local_rows: int
    seq_len: int
    num_params: int
    params: int
    grads: int
    optimizer: int
    activations_resident: int
    activations_transient: int
    device_memory: int | None
    largest_buffer: tuple[int, str] = (0, "")
    # Ways the token axis of activations is split (the sequence rule's mesh axis; 1: not split), and
    # whether the mixers' and MLP's internals are split as well (every head count divides it).
    sequence_split: int = 1
    internals_split: bool = False

    @property
    def total(self) -> int:
        return (
            self.params + self.grads + self.optimizer + self.activations_resident + self.activations_transient
        )

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= self.device_memory


def _local_bytes(shape, dtype, spec, mesh_shape) -> int:
    n = math.prod(shape)
    for entry in tuple(spec):
        for ax in (entry,) if isinstance(entry, str) else tuple(entry or ()):
            n //= mesh_shape[ax]
    return n * np.dtype(dtype).itemsize


def _residual_bytes(fn, *args) -> tuple[int, tuple[int, str]]:
    """Bytes the backward pass of ``fn`` keeps, and the largest single residual (bytes, description)."""
    from jax._src.ad_checkpoint import saved_residuals

    total, largest = 0, (0, "")
    for aval, src in saved_residuals(fn, *args):
        if "from the argument" in src:  # params and batch: counted elsewhere
            continue
        n = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
        total += n
        if n > largest[0]:
            largest = (n, f"{aval.str_short(short_dtypes=True)} {src.splitlines()[0][:120]}")
    return total, largest


def _abstract_batch(rows: int, seq_len: int) -> dict:
    from tmax_jax.rl.packing import BATCH_FIELDS

    ints = ("input_ids", "segment_ids", "positions", "targets")
    return {
        k: jax.ShapeDtypeStruct((rows, seq_len), jnp.int32 if k in ints else jnp.float32)
        for k in BATCH_FIELDS
    }


def _abstract_model(model_cfg, remat: str, dtype, param_dtype):
    from tmax_jax.rl.train_step import make_model

    return nnx.eval_shape(lambda: make_model(model_cfg, remat=remat, dtype=dtype, param_dtype=param_dtype))


def _activation_bytes(model_cfg, cfg: TrainConfig, local_rows: int, dtype, param_dtype, split: int = 1):
    """Residual bytes of the loss on ``local_rows`` whole rows; with ``split`` > 1, the part that grows
    with the row length (traced again at twice the length: what doubles) divided by ``split``."""
    from tmax_jax.rl.train_step import batch_loss

    model = _abstract_model(model_cfg, cfg.rl.train_step.remat, dtype, param_dtype)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, mb):
        return batch_loss(nnx.merge(graphdef, p, rest), mb, cfg.rl.loss, 1.0)[0]

    total, largest = _residual_bytes(loss, params, _abstract_batch(local_rows, cfg.seq_len))
    if split == 1:
        return total, largest
    total2, largest2 = _residual_bytes(loss, params, _abstract_batch(local_rows, 2 * cfg.seq_len))
    growing = min(max(total2 - total, 0), total)
    if largest2[0] >= 2 * largest[0]:
        largest = (largest[0] // split, f"{largest[1]}, 1/{split} per device")
    return total - growing + growing // split, largest


def _sequence_split(cfg: TrainConfig, model_cfg, mesh_shape) -> tuple[int, bool]:
    """(ways the sequence rule splits the token axis, whether the heads' internals split likewise)."""
    from tmax_jax.models.qwen35.config import FULL, LINEAR

    axis = shd.sequence_axis(cfg.mesh.rules)
    t = mesh_shape.get(axis, 1) if axis is not None else 1
    if t == 1:
        return 1, False
    if cfg.seq_len % t:
        raise ConfigError(
            f"seq_len={cfg.seq_len} is not divisible by mesh.{axis}={t}, the axis mesh.rules' 'sequence' "
            f"splits the tokens of activations over: use a multiple of {t}, or map 'sequence' to None"
        )
    # Tensor parallelism splits a mixer's or the MLP's internals only where their parameters are
    # split over the same axis: each head-like rule maps to it and each such size divides it.
    kinds = set(model_cfg.layer_types)
    dims = {} if model_cfg.is_moe else {"mlp": model_cfg.intermediate_size}
    if FULL in kinds:
        dims |= {"q_heads": model_cfg.num_attention_heads, "kv_heads": model_cfg.num_key_value_heads}
    if LINEAR in kinds:
        dims |= {
            "lin_k_heads": model_cfg.linear_num_key_heads,
            "lin_v_heads": model_cfg.linear_num_value_heads,
            "lin_dim": model_cfg.conv_dim,
        }
    rules = dict(cfg.mesh.rules)
    heads = not model_cfg.is_moe and all(rules.get(n) == axis and d % t == 0 for n, d in dims.items())
    return t, heads


def planned_devices(cfg: TrainConfig) -> int:
    return cfg.plan.num_devices or jax.device_count()


def make_plan(cfg: TrainConfig) -> MemoryPlan:
    model_cfg = cfg.model.shape()
    dtype, param_dtype = jnp.dtype(cfg.model.dtype), jnp.dtype(cfg.model.param_dtype)
    sizes = cfg.mesh.resolve(planned_devices(cfg))
    mesh = jax.sharding.AbstractMesh(sizes, shd.MESH_AXES)
    mesh_shape = dict(mesh.shape)

    model = _abstract_model(model_cfg, cfg.rl.train_step.remat, dtype, param_dtype)
    params = nnx.state(model, nnx.Param)
    specs = shd.param_partition_specs(params, mesh, cfg.mesh)
    is_var = lambda x: isinstance(x, nnx.Variable)
    local = jax.tree.map(
        lambda p, s: _local_bytes(p.shape, p.dtype, s.get_value(), mesh_shape), params, specs, is_leaf=is_var
    )
    param_bytes = sum(jax.tree.leaves(local))
    num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))

    optimizer = make_optimizer(cfg.rl.optimizer)
    opt_shapes = jax.eval_shape(optimizer.init, params)
    opt_local = optax.tree_map_params(
        optimizer,
        lambda s, spec: _local_bytes(s.shape, s.dtype, spec.get_value(), mesh_shape),
        opt_shapes,
        specs,
        transform_non_params=lambda s: math.prod(s.shape) * np.dtype(s.dtype).itemsize,
        is_leaf=is_var,
    )
    opt_bytes = sum(jax.tree.leaves(opt_local))
    # Gradients in the param dtype; with accumulation the running sum and one micro-batch's coexist.
    grad_bytes = param_bytes * (2 if cfg.rl.train_step.micro_batches > 1 else 1)

    data_shards = mesh_shape["data"] * mesh_shape["fsdp"]
    local_rows = max(cfg.rows_per_step // data_shards // cfg.rl.train_step.micro_batches, 1)
    remat = cfg.rl.train_step.remat
    t, heads = _sequence_split(cfg, model_cfg, mesh_shape)
    # Whole on every device of the sequence axis: one [rows, T, D] activation.
    whole_row = local_rows * cfg.seq_len * model_cfg.hidden_size * dtype.itemsize
    unsplit = whole_row - whole_row // t
    # With remat="full" the backward keeps only token-wise buffers (period inputs, the final norm,
    # the head's inputs), all split by the sequence rule; "layers" likewise, with every layer's two
    # inputs in place of the periods'; otherwise it keeps the layers' internals.
    tokenwise = remat in ("full", "layers")
    resident, largest = _activation_bytes(
        model_cfg, cfg, local_rows, dtype, param_dtype, t if (tokenwise or heads) else 1
    )
    if t > 1:
        resident += unsplit  # the final hidden states, gathered for the vocab-split LM head
    no_remat = dataclasses.replace(
        cfg, rl=dataclasses.replace(cfg.rl, train_step=dataclasses.replace(cfg.rl.train_step, remat="none"))
    )
    pattern = model_cfg.layer_pattern
    if tokenwise:
        # A period's backward holds its layers' inputs and one layer's internals at a time (each
        # layer is two checkpoints, its mixer half and its MLP half, block.py, each saving its input);
        # the largest layer kind sets the transient. A layer's residuals traced whole bound its
        # larger half's (the MLP's own are its input alone past MLP_CHUNK tokens). With "layers"
        # every layer's inputs are resident already (traced above).
        transient, largest_t = 0, (0, "")
        for kind in sorted(set(pattern)):
            one_layer = dataclasses.replace(model_cfg, num_hidden_layers=1, layer_types=(kind,))
            n, big = _activation_bytes(one_layer, no_remat, local_rows, dtype, param_dtype, t if heads else 1)
            transient, largest_t = max(transient, n), max(largest_t, big)
        if remat == "full":
            transient += 2 * len(pattern) * (whole_row // t)  # the halves' inputs, split by tokens
        largest = max(largest, largest_t)
        if heads:
            transient += 2 * unsplit  # the mixer's and the MLP's all-gathered inputs
    elif remat != "none":
        one_period = dataclasses.replace(model_cfg, num_hidden_layers=len(pattern), layer_types=pattern)
        transient, largest_t = _activation_bytes(
            one_period, no_remat, local_rows, dtype, param_dtype, t if heads else 1
        )
        largest = max(largest, largest_t)
        if heads:
            transient += 2 * len(pattern) * unsplit
    else:
        transient = 0
        if heads:
            resident += 2 * model_cfg.num_hidden_layers * unsplit
    # The float32 head holds [rows, chunk, V] logits, their softmax and its cotangent at once.
    chunk = min(cfg.rl.loss.logprob_chunk, cfg.seq_len)
    transient += 3 * local_rows * chunk * model_cfg.vocab_size * 4
    mem = None if cfg.plan.device_memory_gib is None else int(cfg.plan.device_memory_gib * GiB)
    return MemoryPlan(
        mesh_shape=mesh_shape,
        local_rows=local_rows,
        seq_len=cfg.seq_len,
        num_params=num_params,
        params=param_bytes,
        grads=grad_bytes,
        optimizer=opt_bytes,
        activations_resident=resident,
        activations_transient=transient,
        device_memory=mem,
        largest_buffer=largest,
        sequence_split=t,
        internals_split=heads,
    )


def format_plan(plan: MemoryPlan, cfg: TrainConfig) -> str:
    def gib(n):
        return f"{n / GiB:10.2f} GiB"

    m = plan.mesh_shape
    ts = cfg.rl.train_step
    shape = cfg.model.shape()
    family = "Qwen3" if shape.family == "qwen3" else ("Qwen 3.5 MoE" if shape.is_moe else "Qwen 3.5")
    lines = [
        f"memory plan: {family} {cfg.model.name} ({plan.num_params / 1e9:.2f}B params, "
        f"params {cfg.model.param_dtype}, compute {cfg.model.dtype})",
        f"mesh: data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']} over {math.prod(m.values())} "
        f"x {cfg.plan.device_name}",
        f"batch: {cfg.rows_per_step} rows ({cfg.prompts_per_step} prompts x group {cfg.group_size}) x "
        f"{cfg.seq_len} tokens, {ts.micro_batches} micro-batch(es), "
        f"{plan.local_rows} row(s) per device per micro-batch, remat={ts.remat}",
    ]
    if plan.sequence_split > 1:
        axis = shd.sequence_axis(cfg.mesh.rules)
        inside = (
            "and the layers' internals by heads"
            if plan.internals_split
            else "(layers' internals counted whole: a head count does not divide it)"
        )
        lines.append(
            f"activations: tokens split {plan.sequence_split} ways over {axis} (sequence rule) {inside}"
        )
    lines += [
        "per device:",
        f"  params                 {gib(plan.params)}",
        f"  gradients              {gib(plan.grads)}",
        f"  optimizer (AdamW)      {gib(plan.optimizer)}",
        f"  activations resident   {gib(plan.activations_resident)}",
        f"  activations transient  {gib(plan.activations_transient)}",
        f"  total                  {gib(plan.total)}",
    ]
    if plan.largest_buffer[0]:
        lines.append(f"  largest activation     {gib(plan.largest_buffer[0])}  {plan.largest_buffer[1]}")
    if plan.device_memory is not None:
        verdict = (
            "fits"
            if plan.fits
            else f"does NOT fit (short by {(plan.total - plan.device_memory) / GiB:.2f} GiB)"
        )
        lines.append(f"  device memory          {gib(plan.device_memory)}  -> {verdict}")
    return "\n".join(lines)
