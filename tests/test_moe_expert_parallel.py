"""Expert parallelism with all-to-all dispatch (moe_dispatch) on 8 fake CPU devices: the sparse
MoE block with its experts split over ``fsdp`` gives the unsharded block's output and gradients,
its compiled program moves rows with all-to-all, and its expert weights stay sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tmax_jax import sharding as shd
from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.models.qwen35.moe import SparseMoeBlock

CFG = Qwen35Config.preset("tiny-moe", initializer_range=0.2)  # E=8, top-2, D=64, I=32


def block_and_input(dtype=jnp.float32):
    block = SparseMoeBlock(CFG, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).normal(size=(8, 6, CFG.hidden_size)).astype(np.float32)
    return block, jnp.asarray(x, dtype)


def loss(block, x, ct):
    y, stats, used = block(x)
    return jnp.sum(y.astype(jnp.float32) * ct), (y, used)


grad_fn = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2), (1, 4, 2)])
def test_all_to_all_dispatch_matches_the_unsharded_block(mesh_shape):
    assert len(jax.devices()) == 8
    block, x = block_and_input()
    ct = jnp.asarray(np.random.default_rng(2).normal(size=x.shape), jnp.float32)
    (_, (y_ref, used_ref)), (g_ref, gx_ref) = nnx.jit(grad_fn)(block, x, ct)

    data, fsdp, tensor = mesh_shape
    mesh_cfg = shd.MeshConfig(data=data, fsdp=fsdp, tensor=tensor)
    mesh = shd.make_mesh(mesh_cfg)
    graphdef, params = nnx.split(block)
    params = shd.shard_tree(params, shd.param_shardings(params, mesh, mesh_cfg))
    gu = params["gate_up_proj"][...]
    assert gu.sharding.spec[0] == "fsdp" and gu.addressable_shards[0].data.shape[0] == 8 // fsdp
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(shd.BATCH_AXES, None, None))
    x_s, ct_s = jax.device_put(x, rows), jax.device_put(ct, rows)

    def step(params, x, ct):
        b = nnx.merge(graphdef, params)
        b.expert_axis = "fsdp"
        (_, aux), grads = grad_fn(b, x, ct)
        return aux, grads

    with jax.set_mesh(mesh):
        run = jax.jit(step)
        hlo = run.lower(params, x_s, ct_s).compile().as_text()
        (y, used), (g, gx) = run(params, x_s, ct_s)
    assert "all-to-all" in hlo
    np.testing.assert_array_equal(np.asarray(used), np.asarray(used_ref))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_ref), atol=1e-5, rtol=1e-5)
    for name in ("gate_up_proj", "down_proj", "router"):
        np.testing.assert_allclose(
            np.asarray(g[name][...]), np.asarray(g_ref[name][...]), atol=1e-5, rtol=1e-5, err_msg=name
        )
    assert g["gate_up_proj"][...].sharding.spec[0] == "fsdp"


def test_without_an_expert_axis_or_a_fitting_mesh_the_block_is_unchanged():
    """expert_axis unset, or a mesh whose axis does not divide the experts / the tokens: the
    grouped path runs (no all-to-all) with the same numbers."""
    block, x = block_and_input()
    y_ref = nnx.jit(lambda b, x: b(x)[0])(block, x)
    mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=8, tensor=1))
    graphdef, params = nnx.split(block)

    def fwd(params, x, axis):
        b = nnx.merge(graphdef, params)
        b.expert_axis = axis
        return b(x)[0]

    with jax.set_mesh(mesh):
        for axis, xx in (("fsdp", x[:3]), (None, x)):  # 18 tokens do not split over 8 devices
            run = jax.jit(fwd, static_argnums=2)
            assert "all-to-all" not in run.lower(params, xx, axis).compile().as_text()
            np.testing.assert_allclose(
                np.asarray(run(params, xx, axis)), np.asarray(y_ref[: len(xx)]), atol=1e-5, rtol=1e-5
            )
