"""The SwiGLU's values and hand-written backward (whole, and in chunks) vs a float64 NumPy SwiGLU and
its gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.models.qwen35.mlp import chunked_swiglu, swiglu


def numpy_swiglu_and_grads(x, wg, wu, wd, dy):
    x, wg, wu, wd, dy = (np.asarray(a, np.float64) for a in (x, wg, wu, wd, dy))
    hg, hu = x @ wg, x @ wu
    s = 1 / (1 + np.exp(-hg))
    a = hg * s
    h = a * hu
    dh = dy @ wd.T
    dhg = dh * hu * (s + hg * s * (1 - s))
    dhu = dh * a
    grads = (dhg @ wg.T + dhu @ wu.T, np.einsum("btd,bti->di", x, dhg), np.einsum("btd,bti->di", x, dhu))
    return h @ wd, (*grads, np.einsum("bti,btd->id", h, dy))


@pytest.mark.parametrize("chunked", [True, False], ids=["chunks", "whole"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_swiglu_matches_numpy_float64(dtype, tol, chunked):
    rng = np.random.default_rng(0)
    B, T, D, I = 2, 45, 16, 24  # T % chunk != 0: the last chunk is padded
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    wg, wu = (rng.normal(size=(D, I)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.normal(size=(I, D)).astype(np.float32) * 0.3
    dy = rng.normal(size=(B, T, D)).astype(np.float32)
    ref, ref_grads = numpy_swiglu_and_grads(x, wg, wu, wd, dy)

    def f(x, wg, wu, wd):
        if chunked:
            return chunked_swiglu(x.astype(dtype), wg, wu, wd, 16, jnp.dtype(dtype))
        return swiglu(x.astype(dtype), wg, wu, wd, jnp.dtype(dtype))

    out, vjp = jax.vjp(f, x, wg, wu, wd)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=tol * scale, rtol=tol)
    for name, got, want in zip(("x", "w_gate", "w_up", "w_down"), vjp(jnp.asarray(dy, dtype)), ref_grads):
        assert got.dtype == jnp.float32, name  # cotangents in the primal (float32) dtype
        s = np.abs(want).max()
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * s, rtol=tol, err_msg=name)
