"""The engine on parameters sharded over 8 fake CPU devices gives the single-device engine's tokens."""

import jax
import numpy as np
from flax import nnx
from helpers_hf import make_tiny_hf_checkpoint

from tmax_jax.checkpoints import load_hf
from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams
from tmax_jax.sharding import MeshConfig, make_mesh, param_shardings, shard_tree


def _requests(max_tokens: int) -> list[Request]:
    """Three prompts of 3-5 tokens: greedy, T=1 and T=0.7."""
    return [
        Request(
            prompt=[3, 1, 4, 1, 5, 9, 2, 6][: 3 + i],
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=t, seed=i),
        )
        for i, t in enumerate([0.0, 1.0, 0.7])
    ]


def test_sharded_params_decode_like_single_device(tmp_path):
    assert jax.device_count() == 8
    ckpt = make_tiny_hf_checkpoint(tmp_path, seed=7)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    ref_model = load_hf(ckpt)
    model = load_hf(ckpt)
    state = nnx.state(model)
    nnx.update(model, shard_tree(state, param_shardings(state, mesh)))
    sharded = [x for x in jax.tree.leaves(nnx.state(model)) if len(x.sharding.device_set) == 8]
    assert sharded, "no parameter was placed on the mesh"
    reqs = _requests(6)
    outs = []
    for m in (ref_model, model):
        engine = Engine(m, max_concurrent_decodes=2, max_cache_length=32, max_prefill_length=16)
        with Orchestrator(engine) as orch:
            outs.append(orch.generate(reqs))
        if m is model:
            assert engine.mesh.shape == mesh.shape
    for a, b in zip(*outs):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_speculative_engine_on_sharded_params(tmp_path):
    """A speculative engine on a model sharded over 8 devices, with the MTP module loaded on the
    mesh (load_mtp(mesh=)) and on one other device (the engine replicates it over the model's):
    the single-device plain engine's tokens."""
    from helpers_hf import add_mtp_to_checkpoint

    from tmax_jax.checkpoints import load_mtp

    ckpt = make_tiny_hf_checkpoint(tmp_path, seed=7)
    add_mtp_to_checkpoint(ckpt, seed=8)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    model = load_hf(ckpt, mesh=mesh)
    reqs = _requests(7)
    kw = dict(max_concurrent_decodes=2, max_cache_length=32, max_prefill_length=16)
    with Orchestrator(Engine(load_hf(ckpt), **kw)) as orch:
        ref = orch.generate(reqs)
    placed = load_mtp(ckpt, mesh=mesh)
    assert any(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(nnx.state(placed)))
    elsewhere = load_mtp(ckpt)  # committed to one device: the engine must move it
    nnx.update(elsewhere, jax.device_put(nnx.state(elsewhere), jax.devices()[5]))
    for mtp in (placed, elsewhere):
        engine = Engine(model, mtp=mtp, speculative_tokens=2, **kw)
        with Orchestrator(engine) as orch:
            outs = orch.generate(reqs)
        for a, b in zip(ref, outs):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
