"""Device mesh from config, the logical-axis rules table, and shardings for params, optimizer state
and train batches.

Model code only names logical axes (``embed``, ``mlp``, ``q_heads``...); ``DEFAULT_RULES`` maps them
to the mesh axes ``data``, ``fsdp`` and ``tensor``. Rules are applied through
``nnx.get_partition_spec`` on the model state, then each spec is checked against the parameter's
shape: a mesh axis that does not divide its dimension (tiny models, odd head counts) is dropped for
that dimension rather than failing, and large parameters left fully replicated by the rules are
sharded over ``fsdp`` along their largest divisible dimension (a size-threshold fallback).

Activations follow the same table: rows over ``BATCH_AXES``, and the token axis of the residual
stream over the mesh axis of the ``sequence`` rule (``tensor``): sequence parallelism, see
``shard_tokens``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tmax_jax.errors import ConfigError
from tmax_jax.launch import serial_launch

MESH_AXES = ("data", "fsdp", "tensor")
# Batch rows are split over both data-parallel axes; FSDP is data parallelism with sharded params.
BATCH_AXES = ("data", "fsdp")

# Logical axis -> mesh axis (None = replicated). One table for the whole model.
DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("lin_k_heads", "tensor"),
    ("lin_v_heads", "tensor"),
    ("lin_dim", "tensor"),
    ("conv_kernel", None),
    ("norm", None),
    # MoE: experts are split over fsdp (expert parallelism on the data-parallel devices: each holds
    # whole experts, not slices of every expert); the router's expert axis is small and replicated.
    ("expert", "fsdp"),
    ("expert_logits", None),
    # Activations: the token axis of the residual stream between layers (Megatron-style sequence
    # parallelism). The tensor group's devices would otherwise each hold the same [rows, T, D] hidden
    # states, norms and saved layer inputs; split over T they hold 1/tensor of them, while the
    # head-sharded projections still see every token (``shard_tokens`` / ``gather_tokens``).
    ("sequence", "tensor"),
)


def _rules_dict(rules) -> dict[str, str | None]:
    return {logical: mesh_axis for logical, mesh_axis in rules}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; exactly one may be -1, meaning "all remaining devices"."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    rules: tuple[tuple[str, str | None], ...] = DEFAULT_RULES
    # Parameters with at least this many elements that the rules leave replicated get fsdp-sharded.
    fallback_min_size: int = 1 << 20

    def __post_init__(self) -> None:
        sizes = self.axis_sizes_raw
        if sum(s == -1 for s in sizes) > 1:
            raise ConfigError(f"mesh: at most one axis may be -1, got data/fsdp/tensor = {sizes}")
        bad = [(n, s) for n, s in zip(MESH_AXES, sizes) if s == 0 or s < -1]
        if bad:
            raise ConfigError(f"mesh: axis sizes must be positive or -1, got {bad}")
        for logical, mesh_axis in self.rules:
            if mesh_axis is not None and mesh_axis not in MESH_AXES:
                raise ConfigError(
                    f"mesh.rules: logical axis {logical!r} maps to unknown mesh axis {mesh_axis!r} "
                    f"(mesh axes: {list(MESH_AXES)})"
                )
        seq_axis = _rules_dict(self.rules).get("sequence")
        if seq_axis in BATCH_AXES:
            raise ConfigError(
                f"mesh.rules: 'sequence' maps to {seq_axis!r}, which already splits the batch rows "
                f"({' x '.join(BATCH_AXES)}); map it to 'tensor' or None"
            )

    @property
    def axis_sizes_raw(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """Axis sizes with -1 filled in; raises ConfigError when they do not multiply to the device count."""
        sizes = list(self.axis_sizes_raw)
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ConfigError(
                    f"mesh: {num_devices} devices are not divisible by the fixed axes "
                    f"{dict(zip(MESH_AXES, self.axis_sizes_raw))}"
                )
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ConfigError(
                f"mesh: data*fsdp*tensor = {math.prod(sizes)} but {num_devices} devices are available "
                f"(data/fsdp/tensor = {tuple(sizes)}; use -1 for 'the rest')"
            )
        return tuple(sizes)


def make_mesh(cfg: MeshConfig = MeshConfig(), devices: Sequence | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: every device of every process)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.resolve(len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    # A subset (e.g. the 1-device reference mesh in tests): keep the given order.
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes that do not divide their dimension, or that an earlier dimension already uses."""
    out, used = [], set()
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    for dim, entry in zip(shape, entries):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        kept = []
        for ax in axes:
            size = mesh.shape[ax]
            if ax in used or dim % (math.prod(mesh.shape[a] for a in kept) * size):
                continue
            kept.append(ax)
        used.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*out)


def _fallback_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, min_size: int) -> PartitionSpec:
    if math.prod(shape) < min_size or any(e is not None for e in spec) or mesh.shape["fsdp"] == 1:
        return spec
    fsdp = mesh.shape["fsdp"]
    for d in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if shape[d] % fsdp == 0:
            entries = [None] * len(shape)
            entries[d] = "fsdp"
            return PartitionSpec(*entries)
    return spec


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def check_logical_names(state, rules) -> None:
    """Every logical name on every variable must be in the rules table (a typo would silently replicate)."""
    known = _rules_dict(rules)

    def check(path, var):
        names = var.get_metadata().get("out_sharding")
        for n in names or ():
            if n is not None and n not in known:
                where = "/".join(str(getattr(p, "key", p)) for p in path)
                raise ConfigError(
                    f"parameter {where} has logical axis {n!r} that mesh.rules does not map "
                    f"(known: {sorted(known)})"
                )

    jax.tree_util.tree_map_with_path(check, state, is_leaf=_is_var)


def param_partition_specs(state, mesh: Mesh, cfg: MeshConfig = MeshConfig()):
    """The state's tree with each Variable's value replaced by its PartitionSpec (mesh axes)."""
    check_logical_names(state, cfg.rules)
    with nnx.logical_axis_rules(cfg.rules):
        specs = nnx.get_partition_spec(state)

    def fit(spec_var, value_var):
        shape = value_var.shape
        spec = fit_spec(spec_var.get_value(), shape, mesh)
        return spec_var.replace(_fallback_spec(spec, shape, mesh, cfg.fallback_min_size))

    return jax.tree.map(fit, specs, state, is_leaf=_is_var)


def param_shardings(state, mesh: Mesh, cfg: MeshConfig = MeshConfig()):
    """NamedShardings for ``state`` (same tree: Variables holding NamedSharding values)."""
    specs = param_partition_specs(state, mesh, cfg)
    return jax.tree.map(lambda v: v.replace(NamedSharding(mesh, v.get_value())), specs, is_leaf=_is_var)


def shard_tree(tree, shardings):
    """Place (or reshard) every array of ``tree`` with the matching sharding."""
    with serial_launch():  # a reshard runs collectives
        return jax.device_put(tree, shardings)


def optimizer_shardings(optimizer, opt_state, params_shardings, mesh: Mesh):
    """Shard every params-shaped part of an optax state like the params; replicate the rest (counts)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        opt_state,
        params_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=_is_var,
    )


def activation_rules() -> tuple[tuple[str, str | None], ...]:
    """The rules in force while a model is traced: flax's ``nnx.logical_axis_rules`` context when one
    is set, ``DEFAULT_RULES`` otherwise (as the kernels' and attention's shard_map do). They are read
    when a function is traced: a jitted function keeps the rules of its first trace."""
    from flax.core import spmd

    return tuple(spmd.get_logical_axis_rules()) or DEFAULT_RULES


def sequence_axis(rules=None) -> str | None:
    """The mesh axis the ``sequence`` rule splits the token axis of activations over (None: off)."""
    return _rules_dict(activation_rules() if rules is None else rules).get("sequence")


def _constrain_tokens(x_BxTxD: jax.Array, split: bool) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x_BxTxD
    seq = sequence_axis()
    if seq is None or mesh.shape.get(seq, 1) == 1:
        return x_BxTxD  # nothing to split: leave XLA's choices (and the program) as they were
    spec = PartitionSpec(BATCH_AXES, seq if split else None, *([None] * (x_BxTxD.ndim - 2)))
    return jax.lax.with_sharding_constraint(x_BxTxD, fit_spec(spec, x_BxTxD.shape, mesh))


def shard_tokens(x_BxTxD: jax.Array) -> jax.Array:
    """The residual stream ``[B, T, ...]`` split over rows and, by the ``sequence`` rule, over tokens.

    Under the ambient mesh (``jax.set_mesh``) only; a no-op without one, when the rule is off, or
    when its axis does not divide T (decode steps, short prefills), as ``fit_spec`` drops such axes
    for parameters. Values are unchanged: between a head-sharded projection's partial sums and this
    constraint XLA reduce-scatters instead of all-reducing.
    """
    return _constrain_tokens(x_BxTxD, split=True)


def gather_tokens(x_BxTxD: jax.Array) -> jax.Array:
    """``[B, T, ...]`` whole over the ``sequence`` axis: the input of head-sharded projections.

    Pinned explicitly so that XLA all-gathers the (normed) tokens before the projections rather
    than carrying the token split into the mixers, which need every token of their head shard (the
    delta rule's recurrence, causal attention)."""
    return _constrain_tokens(x_BxTxD, split=False)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over (data, fsdp); the sequence and feature dims replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def batch_shardings(batch: Mapping, mesh: Mesh) -> dict:
    return {k: batch_sharding(mesh, np.ndim(v)) for k, v in batch.items()}


def global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Assemble a global batch from this process's rows (multi-host: each host feeds its own slice)."""
    out = {}
    for k, v in local_batch.items():
        sharding = batch_sharding(mesh, np.ndim(v))
        rows = mesh.shape["data"] * mesh.shape["fsdp"]
        global_rows = np.shape(v)[0] * jax.process_count()
        if global_rows % rows:
            raise ConfigError(
                f"batch field {k!r}: {global_rows} global rows are not divisible by data*fsdp = {rows}"
            )
        out[k] = jax.make_array_from_process_local_data(sharding, np.asarray(v))
    return out


def describe(tree, limit: int = 0) -> list[str]:
    """'path: shape spec' lines for a tree of sharded arrays (debugging, the plan command)."""
    lines = []

    def visit(path, x):
        where = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        lines.append(f"{where}: {tuple(np.shape(x))} {spec}")

    jax.tree_util.tree_map_with_path(visit, tree)
    return lines[:limit] if limit else lines


def local_mesh_config(cfg: MeshConfig, num_local_devices: int) -> MeshConfig:
    """The mesh for one process's own devices: the configured tensor axis where it fits inside one
    process (tensor parallelism stays on the fast local links), fsdp over the rest."""
    tensor = math.gcd(cfg.tensor if cfg.tensor > 0 else num_local_devices, num_local_devices)
    return dataclasses.replace(cfg, data=1, fsdp=-1, tensor=tensor)


class ProcessReplicas:
    """One full copy of a param tree per process, held on that process's own devices.

    Multi-host RL samples on every host with a local engine: after each train step the params,
    sharded over the global mesh, are resharded (``jax.device_put``, collectives over all processes)
    onto a ``(process, data, fsdp, tensor)`` mesh whose specs never use the ``process`` axis, so every
    process ends up with a complete copy sharded over its local mesh; those addressable shards then
    become an ordinary process-local array. Every process must call it at the same point.
    """

    PROCESS_AXIS = "process"

    def __init__(self, params, cfg: MeshConfig = MeshConfig()):
        pid, nproc = jax.process_index(), jax.process_count()
        by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(nproc)]
        counts = {len(ds) for ds in by_process}
        if len(counts) != 1:
            raise ConfigError(
                f"processes have different device counts {sorted(counts)}: no common local mesh"
            )
        n_local = counts.pop()
        self.mesh_cfg = local_mesh_config(cfg, n_local)
        shape = self.mesh_cfg.resolve(n_local)
        auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
        self.local_mesh = Mesh(np.asarray(by_process[pid]).reshape(shape), MESH_AXES, axis_types=auto)
        self.global_mesh = Mesh(
            np.asarray(by_process).reshape((nproc, *shape)),
            (self.PROCESS_AXIS, *MESH_AXES),
            axis_types=(jax.sharding.AxisType.Auto,) * (len(MESH_AXES) + 1),
        )
        specs = param_partition_specs(params, self.local_mesh, self.mesh_cfg)
        self.local_shardings = jax.tree.map(
            lambda v: v.replace(NamedSharding(self.local_mesh, v.get_value())), specs, is_leaf=_is_var
        )
        self.replica_shardings = jax.tree.map(
            lambda v: v.replace(NamedSharding(self.global_mesh, v.get_value())), specs, is_leaf=_is_var
        )

    def __call__(self, params):
        """This process's copy of ``params`` (a new buffer: later donation of ``params`` is safe)."""

        def local(src, replica, sharding):
            shards = [s.data for s in replica.addressable_shards]
            out = jax.make_array_from_single_device_arrays(replica.shape, sharding, shards)
            # device_put may hand back the very same buffers when nothing moves; copy those.
            return out.copy() if replica is src else out

        with serial_launch():  # the reshard runs collectives over all processes
            replicas = jax.device_put(params, self.replica_shardings)
            return jax.tree.map(local, params, replicas, self.local_shardings)
