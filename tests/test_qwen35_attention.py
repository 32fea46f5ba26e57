"""Masked GQA attention: the unblocked softmax, the flash form with its own backward, the TPU splash
kernel and the GPU Triton kernel (Pallas interpret mode) against float64 NumPy values and hand-written
gradients; the ``attention_kernels`` choice."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.models.qwen35.attention import (
    attention_kernel,
    masked_attention,
    splash_attention,
    triton_attention,
)
from tmax_jax.models.qwen35.flash_attention import flash_attention


def numpy_attention(q, k, v, seg):
    B, T, G, R, E = q.shape
    out = np.zeros_like(q, dtype=np.float64)
    for b in range(B):
        for t in range(T):
            ok = (np.arange(T) <= t) & (seg[b] == seg[b, t])
            for g in range(G):
                s = k[b, ok, g] @ q[b, t, g].T / np.sqrt(E)  # [S_ok, R]
                p = np.exp(s - s.max(0))
                p /= p.sum(0)
                out[b, t, g] = (p.T @ v[b, ok, g]).astype(np.float64)
    return out


def test_blocked_and_unblocked_attention_match_numpy_with_packing_and_padding():
    rng = np.random.default_rng(0)
    B, T, G, R, E = 2, 150, 2, 2, 8
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in [(B, T, G, R, E), (B, T, G, E), (B, T, G, E)])
    seg = np.ones((B, T), np.int32)
    seg[0, 60:] = 2
    seg[1, 140:] = 0
    idx = jnp.broadcast_to(jnp.arange(T), (B, T))

    def run(q, block, causal_self=False):
        return masked_attention(q, k, v, idx, seg, jnp.arange(T), seg, block=block, causal_self=causal_self)

    full = np.asarray(run(q, 1024))
    np.testing.assert_allclose(full, numpy_attention(q, k, v, seg), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(run(q, 32)), full, atol=1e-6, rtol=1e-6)
    # Causal self-attention skips the keys after each query block (blocks of 128: 128 + a ragged 22).
    causal = np.asarray(run(q, 1024, causal_self=True))
    np.testing.assert_allclose(causal, numpy_attention(q, k, v, seg), atol=1e-5, rtol=1e-5)
    g_full = jax.grad(lambda q: (run(q, 1024) ** 2).sum())(q)
    g_blk = jax.grad(lambda q: (run(q, 32) ** 2).sum())(q)
    np.testing.assert_allclose(np.asarray(g_blk), np.asarray(g_full), atol=1e-5, rtol=1e-5)
    causal_loss = lambda q, k, v: (  # noqa: E731
        masked_attention(q, k, v, idx, seg, jnp.arange(T), seg, causal_self=True) ** 2
    ).sum()
    dq, dk, dv = jax.grad(causal_loss, argnums=(0, 1, 2))(q, k, v)
    dout = 2 * numpy_attention(q, k, v, seg)
    _, (rq, rk, rv) = numpy_attention_and_grads(q, k, v, np.asarray(idx), seg, np.arange(T), seg, dout)
    for name, got, want in zip("qkv", (dq, dk, dv), (rq, rk, rv)):
        np.testing.assert_allclose(np.asarray(got), want, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")


def numpy_attention_and_grads(q, k, v, q_idx, q_seg, k_idx, k_seg, dout):
    """Float64 forward and the hand-written softmax-attention backward (dQ, dK, dV)."""
    q, k, v, dout = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    B, T, G, R, E = q.shape
    out, dq, dk, dv = np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    scale = 1 / np.sqrt(E)
    for b in range(B):
        ok = (k_idx[None, :] <= q_idx[b][:, None]) & (k_seg[b][None, :] == q_seg[b][:, None])  # [T, S]
        for g in range(G):
            for r in range(R):
                s = np.where(ok, q[b, :, g, r] @ k[b, :, g].T * scale, -1e300)
                p = np.exp(s - s.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                out[b, :, g, r] = p @ v[b, :, g]
                do = dout[b, :, g, r]
                dp = do @ v[b, :, g].T
                ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
                dq[b, :, g, r] = ds @ k[b, :, g]
                dk[b, :, g] += ds.T @ q[b, :, g, r]
                dv[b, :, g] += p.T @ do
    return out, (dq, dk, dv)


@pytest.mark.parametrize(
    "T,S,R,block",
    [
        (150, 150, 2, 32),  # self-attention, GQA 2 queries per kv head, T % block != 0
        (70, 200, 3, 64),  # queries after a cache: keys at other positions than queries
    ],
)
def test_flash_attention_values_and_gradients_match_numpy_float64(T, S, R, block):
    rng = np.random.default_rng(T + S)
    B, G, E = 2, 2, 8
    q = rng.normal(size=(B, T, G, R, E)).astype(np.float32)
    k, v = (rng.normal(size=(B, S, G, E)).astype(np.float32) for _ in range(2))
    dout = rng.normal(size=q.shape).astype(np.float32)
    if T == S:  # packing: row 0 holds two sequences, row 1 ends in pads (segment 0)
        q_idx = np.broadcast_to(np.arange(T), (B, T)).astype(np.int32)
        q_seg = np.ones((B, T), np.int32)
        q_seg[0, 60:], q_seg[1, 140:] = 2, 0
        k_idx, k_seg = np.arange(S, dtype=np.int32), q_seg
    else:  # cache layout: queries at slots len_b.., keys past each row's new length are empty
        lens = np.array([40, 130])
        q_idx = (lens[:, None] + np.arange(T)).astype(np.int32)
        q_seg = np.ones((B, T), np.int32)
        k_idx = np.arange(S, dtype=np.int32)
        k_seg = (k_idx[None, :] < (lens + T)[:, None]).astype(np.int32)
    ref, ref_grads = numpy_attention_and_grads(q, k, v, q_idx, q_seg, k_idx, k_seg, dout)

    def run(q, k, v):
        return flash_attention(q, k, v, q_idx, q_seg, k_idx, k_seg, block, block)

    out, vjp = jax.vjp(run, q, k, v)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)
    for name, got, want in zip("qkv", vjp(jnp.asarray(dout)), ref_grads):
        np.testing.assert_allclose(np.asarray(got), want, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")
    # The model's entry point picks the flash form past its block and agrees with it.
    via_masked = masked_attention(q, k, v, q_idx, q_seg, k_idx, k_seg, block=block)
    np.testing.assert_allclose(np.asarray(via_masked), np.asarray(out), atol=1e-6, rtol=1e-6)


def test_flash_attention_backward_keeps_no_score_matrix():
    """Saved residuals are inputs, output and the float32 log-sum-exp: nothing of size T x S."""
    B, T, G, R, E = 1, 1024, 1, 2, 16
    q = jnp.zeros((B, T, G, R, E), jnp.bfloat16)
    k = jnp.zeros((B, T, G, E), jnp.bfloat16)
    idx = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = jnp.ones((B, T), jnp.int32)
    _, res = jax.vjp(lambda q, k: flash_attention(q, k, k, idx, seg, jnp.arange(T), seg, 128, 128), q, k)
    sizes = sorted(int(np.prod(a.shape)) for a in jax.tree.leaves(res))
    assert max(sizes) == B * T * G * R * E and T * T not in sizes


def test_splash_kernel_in_interpret_mode_matches_numpy_float64():
    rng = np.random.default_rng(1)
    B, T, G, R, E = 1, 256, 2, 2, 128
    q = rng.normal(size=(B, T, G, R, E)).astype(np.float32)
    k, v = (rng.normal(size=(B, T, G, E)).astype(np.float32) for _ in range(2))
    dout = rng.normal(size=q.shape).astype(np.float32)
    seg = np.ones((B, T), np.int32)
    seg[0, 100:], seg[0, 240:] = 2, 0
    idx = np.broadcast_to(np.arange(T), (B, T)).astype(np.int32)
    ref, ref_grads = numpy_attention_and_grads(q, k, v, idx, seg, np.arange(T), seg, dout)
    out, vjp = jax.vjp(lambda q, k, v: splash_attention(q, k, v, seg, interpret=True), q, k, v)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)
    for name, got, want in zip("qkv", vjp(jnp.asarray(dout)), ref_grads):
        np.testing.assert_allclose(np.asarray(got), want, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")


@pytest.mark.parametrize(
    "B,T,G,R,E",
    [
        (2, 150, 2, 3, 64),  # forward blocks of 128: T padded to 256; GQA 3 queries per kv head
        (1, 100, 1, 2, 256),  # Qwen 3.5's head dim: blocks of 64, T padded to 128
    ],
)
def test_triton_kernel_in_interpret_mode_matches_numpy_float64(B, T, G, R, E):
    """JAX's Pallas GPU flash-attention kernel behind ``triton_attention`` (interpret mode): packed rows,
    a row ending in pads, GQA through repeated kv heads, values and all three gradients."""
    rng = np.random.default_rng(T + E)
    q = rng.normal(size=(B, T, G, R, E)).astype(np.float32)
    k, v = (rng.normal(size=(B, T, G, E)).astype(np.float32) for _ in range(2))
    dout = rng.normal(size=q.shape).astype(np.float32)
    seg = np.ones((B, T), np.int32)
    seg[0, 45:] = 2
    seg[-1, T - 12 :] = 0
    idx = np.broadcast_to(np.arange(T), (B, T)).astype(np.int32)
    ref, ref_grads = numpy_attention_and_grads(q, k, v, idx, seg, np.arange(T), seg, dout)
    out, vjp = jax.vjp(lambda q, k, v: triton_attention(q, k, v, seg, interpret=True), q, k, v)
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)
    for name, got, want in zip("qkv", vjp(jnp.asarray(dout)), ref_grads):
        np.testing.assert_allclose(np.asarray(got), want, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")
    # masked_attention hands causal self-attention past its block to the kernel with "pallas".
    via = masked_attention(q, k, v, idx, seg, np.arange(T), seg, block=32, causal_self=True, kernels="pallas")
    np.testing.assert_allclose(np.asarray(via), np.asarray(out), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kernel,T,E", [(splash_attention, 128, 128), (triton_attention, 64, 32)])
def test_kernels_under_a_mesh_run_per_shard_and_match_numpy(kernel, T, E):
    """On 8 fake devices (rows over data x fsdp, kv heads over tensor) the TPU splash and the GPU
    Triton kernels (interpret mode) run in shard_map."""
    from tmax_jax.sharding import MeshConfig, make_mesh

    rng = np.random.default_rng(2)
    B, G, R = 4, 2, 2
    q = rng.normal(size=(B, T, G, R, E)).astype(np.float32)
    k, v = (rng.normal(size=(B, T, G, E)).astype(np.float32) for _ in range(2))
    seg = np.ones((B, T), np.int32)
    seg[1, T // 2 :], seg[3, T - 20 :] = 2, 0
    idx = np.broadcast_to(np.arange(T), (B, T)).astype(np.int32)
    ref, _ = numpy_attention_and_grads(q, k, v, idx, seg, np.arange(T), seg, np.zeros_like(q))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda q, k, v, s: kernel(q, k, v, s, interpret=True))
        lowered = fn.lower(q, k, v, seg).as_text()
        out = fn(q, k, v, seg)
    assert "shard_map" in lowered or "sdy.manual_computation" in lowered
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)


def test_triton_kernel_lowers_for_gpu_at_qwen35_head_dim():
    """From this CPU host, the forward and backward lower to Triton IR at Qwen 3.5's attention shape
    (head dim 256, 8 query heads over 2 kv heads, bfloat16): the block sizes and every primitive pass
    Pallas's Triton lowering. Whether Triton then fits them on a chip is device_check's part."""
    from jax import export

    B, T, G, R, E = 1, 1024, 2, 4, 256
    q = jax.ShapeDtypeStruct((B, T, G, R, E), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, G, E), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss(q, k, v, seg):
        return jnp.sum(triton_attention(q, k, v, seg).astype(jnp.float32))

    train = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    module = export.export(train, platforms=["cuda"], disabled_checks=unchecked)(q, kv, kv, seg).mlir_module()
    names = re.findall(r'name = "(mha[a-z_]*|[a-z_]*mha[a-z_]*)"', module)
    assert module.count("xla.gpu.triton") >= 3, names  # forward, and the backward's kernels
    assert "grid_x = 16" in module  # forward: 1024 / 64 query blocks at head dim 256


def test_attention_kernels_choice_by_backend_and_config():
    from tmax_jax.errors import ConfigError
    from tmax_jax.models.qwen35 import Qwen35Config
    from tmax_jax.models.qwen35.attention import GatedAttention

    assert attention_kernel("auto", 2048, "tpu") == ("splash", False)
    assert attention_kernel("auto", 1000, "tpu") == ("flash", False)  # rows splash's block does not divide
    assert attention_kernel("auto", 2048, "gpu") == ("flash", False)  # until device_check has run it
    assert attention_kernel("auto", 2048, "cpu") == ("flash", False)
    assert attention_kernel("pallas", 2048, "gpu") == ("triton", False)
    assert attention_kernel("pallas", 2048, "cpu") == ("triton", True)
    assert attention_kernel("jax", 2048, "tpu") == ("flash", False)
    with pytest.raises(ValueError, match="attention_kernels='cudnn'"):
        attention_kernel("cudnn", 2048, "gpu")
    with pytest.raises(ConfigError, match="attention_kernels='flash'"):
        Qwen35Config.preset("tiny", attention_kernels="flash")
    cfg = Qwen35Config.preset("tiny", attention_kernels="pallas")
    assert "attention_kernels" not in cfg.to_hf_config()
    assert (
        Qwen35Config.from_hf_config({**cfg.to_hf_config(), "attention_kernels": "pallas"}).attention_kernels
        == "auto"
    )
    layer = GatedAttention(
        cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=__import__("flax").nnx.Rngs(0)
    )
    assert layer.kernels == "pallas"


@pytest.mark.parametrize("axis", [2, 3])
def test_write_rows_matches_a_dropping_scatter(axis):
    """The decode cache's row-wise write: row b's valid tokens at start[b] + t, pads and positions
    past the cache untouched, for both cache layouts (positions on axis 2 or 3) and T = 1, 3."""
    from tmax_jax.models.qwen35.attention import write_rows

    rng = np.random.default_rng(0)
    B, G, E, S = 5, 2, 3, 8
    shape = (B, G, S, E) if axis == 2 else (B, G, E, S)
    cache = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    for T in (1, 3):
        new_shape = list(shape)
        new_shape[axis] = T
        new = jnp.asarray(rng.normal(size=new_shape), jnp.float32)
        start = jnp.asarray([0, 4, S - 2, S, S - 1][:B], jnp.int32)  # the last two run off the end
        valid = jnp.asarray(rng.random((B, T)) > 0.3)
        want = np.asarray(cache, np.float32).copy()
        for b in range(B):
            for t in range(T):
                if valid[b, t] and start[b] + t < S:
                    src = np.take(np.asarray(new[b].astype(jnp.bfloat16), np.float32), t, axis=axis - 1)
                    idx = [b, slice(None), slice(None), slice(None)]
                    idx[axis] = int(start[b]) + t
                    want[tuple(idx)] = src
        got = jax.jit(write_rows, static_argnames="axis")(cache, new, start, valid, axis=axis)
        assert got.dtype == cache.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
