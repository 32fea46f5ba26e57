"""Per-device memory of a training run, from shapes only (``nnx.eval_shape`` / traced residuals).

Nothing is allocated, so a laptop can tell whether Qwen 3.5 9B at 64K tokens fits a v5p-64 or an
8x H200 host before either is rented. Parameters, gradients and AdamW moments are exact for the given
mesh and rules. Activations come from ``saved_residuals`` of the real train loss traced at the
per-device micro-batch: *resident* is what the backward pass keeps for the whole model (with the
configured remat), *transient* is what one rematerialised piece holds while its backward runs (with
``remat="full"``: a period's layer inputs plus the largest single layer's internals; otherwise one
layer-pattern period's internals) plus the float32 LM-head chunk buffers. Tensor-parallel splits of activations are not divided out,
so activations are an upper bound when ``mesh.tensor`` > 1.
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


def _activation_bytes(model_cfg, cfg: TrainConfig, local_rows: int, dtype, param_dtype):
    from tmax_jax.rl.train_step import batch_loss

    model = _abstract_model(model_cfg, cfg.rl.train_step.remat, dtype, param_dtype)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, mb):
        return batch_loss(nnx.merge(graphdef, p, rest), mb, cfg.rl.loss, 1.0)[0]

    return _residual_bytes(loss, params, _abstract_batch(local_rows, cfg.seq_len))


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
    resident, largest = _activation_bytes(model_cfg, cfg, local_rows, dtype, param_dtype)
    remat = cfg.rl.train_step.remat
    no_remat = dataclasses.replace(
        cfg, rl=dataclasses.replace(cfg.rl, train_step=dataclasses.replace(cfg.rl.train_step, remat="none"))
    )
    pattern = model_cfg.layer_pattern
    if remat == "full":
        # A period's backward holds its layers' inputs and one layer's internals at a time (each
        # layer is its own checkpoint, block.py); the largest layer kind sets the transient.
        transient, largest_t = 0, (0, "")
        for kind in sorted(set(pattern)):
            one_layer = dataclasses.replace(model_cfg, num_hidden_layers=1, layer_types=(kind,))
            n, big = _activation_bytes(one_layer, no_remat, local_rows, dtype, param_dtype)
            transient, largest_t = max(transient, n), max(largest_t, big)
        transient += len(pattern) * local_rows * cfg.seq_len * model_cfg.hidden_size * dtype.itemsize
        largest = max(largest, largest_t)
    elif remat != "none":
        one_period = dataclasses.replace(model_cfg, num_hidden_layers=len(pattern), layer_types=pattern)
        transient, largest_t = _activation_bytes(one_period, no_remat, local_rows, dtype, param_dtype)
        largest = max(largest, largest_t)
    else:
        transient = 0
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
