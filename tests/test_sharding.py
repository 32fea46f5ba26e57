"""Mesh from config and the logical-axis rules, on 8 fake CPU devices."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tmax_jax.errors import ConfigError
from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.rl.train_step import make_model
from tmax_jax.sharding import (
    DEFAULT_RULES,
    MeshConfig,
    fit_spec,
    global_batch,
    make_mesh,
    param_partition_specs,
    param_shardings,
    shard_tree,
)


def test_mesh_fills_minus_one_and_checks_counts():
    assert MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 2)
    assert MeshConfig(data=1, fsdp=1, tensor=-1).resolve(8) == (1, 1, 8)
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ConfigError, match="not divisible"):
        MeshConfig(data=3, fsdp=-1).resolve(8)
    with pytest.raises(ConfigError, match="8 devices are available"):
        MeshConfig(data=2, fsdp=2, tensor=1).resolve(8)
    with pytest.raises(ConfigError, match="at most one axis"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ConfigError, match="unknown mesh axis 'model'"):
        MeshConfig(rules=(("embed", "model"),))


def test_fit_spec_drops_axes_that_do_not_divide():
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    assert fit_spec(P("tensor", "fsdp"), (512, 64), mesh) == P("tensor", "fsdp")
    assert fit_spec(P("tensor", "fsdp"), (3, 64), mesh) == P(None, "fsdp")
    assert fit_spec(P("tensor", "tensor"), (4, 4), mesh) == P("tensor", None)  # one mesh axis once
    assert fit_spec(P(("fsdp", "tensor")), (16,), mesh) == P(("fsdp", "tensor"))


@pytest.fixture(scope="module")
def tiny_params():
    model = make_model(Qwen35Config.preset("tiny"), remat="none")
    return nnx.state(model, nnx.Param)


def test_every_model_param_is_sharded_as_the_rules_say(tiny_params):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    cfg = MeshConfig(data=2, fsdp=2, tensor=2)
    placed = shard_tree(tiny_params, param_shardings(tiny_params, mesh, cfg))
    rules = dict(DEFAULT_RULES)
    n_sharded = 0
    for path, var in jax.tree_util.tree_leaves_with_path(
        placed, is_leaf=lambda x: isinstance(x, nnx.Variable)
    ):
        names = var.get_metadata().get("out_sharding")
        assert names and len(names) == var.ndim, f"{path}: no logical axis names"
        arr = var.get_value()
        spec = tuple(arr.sharding.spec) + (None,) * (arr.ndim - len(arr.sharding.spec))
        used = set()
        for dim, (name, got) in enumerate(zip(names, spec)):
            want = rules[name]
            divides = want is not None and arr.shape[dim] % mesh.shape[want] == 0 and want not in used
            assert got == (want if divides else None), (path, names, spec)
            if got is not None:
                used.add(got)
                n_sharded += 1
                # Each device really holds a slice, not a replica.
                assert arr.addressable_shards[0].data.shape[dim] == arr.shape[dim] // mesh.shape[got]
    assert n_sharded > 10


def test_unknown_logical_axis_is_named(tiny_params):
    class Odd(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(
                np.ones((4, 4), np.float32), out_sharding=("embed", "headz"), eager_sharding=False
            )

    mesh = make_mesh(MeshConfig())
    with pytest.raises(ConfigError, match="'headz'"):
        param_partition_specs(nnx.state(Odd(), nnx.Param), mesh)


def test_size_threshold_fallback_shards_large_unannotated_params():
    class Plain(nnx.Module):
        def __init__(self):
            self.big = nnx.Param(np.ones((64, 48), np.float32))
            self.small = nnx.Param(np.ones((8,), np.float32))

    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    specs = param_partition_specs(
        nnx.state(Plain(), nnx.Param), mesh, MeshConfig(fsdp=8, fallback_min_size=1024)
    )
    assert specs["big"].get_value() == P("fsdp", None)
    assert specs["small"].get_value() == P(None)


def test_global_batch_rows_are_split_over_data_and_fsdp():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    local = {"input_ids": np.arange(8 * 6, dtype=np.int32).reshape(8, 6)}
    arr = global_batch(local, mesh)["input_ids"]
    assert arr.sharding.spec == P(("data", "fsdp"), None)
    assert arr.addressable_shards[0].data.shape == (2, 6)
    np.testing.assert_array_equal(np.asarray(arr), local["input_ids"])
    with pytest.raises(ConfigError, match="not divisible by data\\*fsdp = 4"):
        global_batch({"input_ids": np.zeros((6, 2), np.int32)}, mesh)
