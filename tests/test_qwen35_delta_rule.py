"""The gated delta rule: chunked == recurrent == a NumPy loop == transformers' torch reference,
packing restarts the state exactly, pads are no-ops, and the chunked form's own backward pass matches a
hand-written float64 NumPy backward and autodiff of the recurrent form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from delta_rule_reference import numpy_forward_backward

from tmax_jax.models.qwen35.delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule


def numpy_delta_rule(q, k, v, g, beta, s0=None, groups=None):
    """Straight per-token loop in float64; the state restarts from zero when the group changes."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    out = np.zeros((B, T, H, V))
    finals = np.zeros((B, H, K, V))
    for b in range(B):
        s = np.zeros((H, K, V)) if s0 is None else s0[b].astype(np.float64)
        prev = 0
        for t in range(T):
            grp = 0 if groups is None else groups[b, t]
            if grp != prev:
                s = np.zeros((H, K, V))
                prev = grp
            s = s * np.exp(g[b, t])[:, None, None]
            pred = np.einsum("hk,hkv->hv", k[b, t], s)
            delta = (v[b, t] - pred) * beta[b, t][:, None]
            s = s + k[b, t][:, :, None] * delta[:, None, :]
            out[b, t] = np.einsum("hk,hkv->hv", q[b, t], s)
        finals[b] = s
    return out, finals


def make_inputs(seed, B=2, T=150, H=3, K=8, V=6):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, K))
    k = rng.normal(size=(B, T, H, K))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * K**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, T, H, V))
    g = -np.log1p(np.exp(rng.normal(size=(B, T, H))))  # -softplus: decays in (0, 1)
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
    s0 = rng.normal(size=(B, H, K, V))
    return [x.astype(np.float32) for x in (q, k, v, g, beta, s0)]


chunked = jax.jit(chunked_gated_delta_rule, static_argnames="chunk_size")
recurrent = jax.jit(recurrent_gated_delta_rule)


def test_chunked_equals_recurrent_equals_numpy():
    q, k, v, g, beta, s0 = make_inputs(0)
    ref_o, ref_s = numpy_delta_rule(q, k, v, g, beta, s0)
    o_c, s_c = chunked(q, k, v, g, beta, s0)
    o_r, s_r = recurrent(q, k, v, g, beta, s0)
    assert o_c.dtype == jnp.float32 and s_c.dtype == jnp.float32
    np.testing.assert_allclose(o_c, ref_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s_c, ref_s, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(o_r, ref_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s_r, ref_s, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_matches_transformers_torch_reference(chunk_size):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    q, k, v, g, beta, s0 = make_inputs(1, T=100)
    o, s = chunked(q, k, v, g, beta, s0, chunk_size=chunk_size)
    # transformers scales q by dk^-0.5 itself (our inputs come pre-scaled) and is left to not
    # re-normalise (our q/k are already unit vectors).
    t = [torch.from_numpy(x) for x in (q * q.shape[-1] ** 0.5, k, v, g, beta, s0)]
    ref_o, ref_s = ref.torch_chunk_gated_delta_rule(
        t[0],
        t[1],
        t[2],
        g=t[3],
        beta=t[4],
        chunk_size=chunk_size,
        initial_state=t[5],
        output_final_state=True,
    )
    np.testing.assert_allclose(o, ref_o.numpy(), atol=3e-5, rtol=1e-4)
    np.testing.assert_allclose(s, ref_s.numpy(), atol=3e-5, rtol=1e-4)


def test_packed_groups_restart_state_exactly():
    q, k, v, g, beta, _ = make_inputs(2, B=1, T=150)
    # Three packed segments, boundaries inside and across 64-token chunks.
    groups = np.zeros((1, 150), np.int32)
    groups[0, :40], groups[0, 40:101], groups[0, 101:] = 1, 2, 3
    o, s = chunked(q, k, v, g, beta, None, jnp.asarray(groups))
    ref_o, ref_s = numpy_delta_rule(q, k, v, g, beta, None, groups)
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s, ref_s, atol=2e-5, rtol=1e-4)
    # Each segment alone from a zero state gives the same outputs.
    for lo, hi in [(0, 40), (40, 101), (101, 150)]:
        o_seg, _ = chunked(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], None)
        np.testing.assert_allclose(o[:, lo:hi], o_seg, atol=2e-5, rtol=1e-4)


def test_tokens_with_zero_decay_and_beta_leave_the_state_unchanged():
    q, k, v, g, beta, s0 = make_inputs(3, T=90)
    n = 70
    g2, beta2 = g.copy(), beta.copy()
    g2[:, n:], beta2[:, n:] = 0.0, 0.0
    _, s_pad = chunked(q, k, v, g2, beta2, s0)
    _, s_trim = chunked(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0)
    np.testing.assert_allclose(s_pad, s_trim, atol=1e-6, rtol=1e-6)
    _, s_step = recurrent(q[:, :1], k[:, :1], v[:, :1], g2[:, n : n + 1], beta2[:, n : n + 1], s0)
    np.testing.assert_array_equal(s_step, s0)


def _cotangents(seed, q, v, s0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=q.shape[:3] + v.shape[-1:]).astype(np.float32), rng.normal(size=s0.shape).astype(
        np.float32
    )


def _grads(fn, args, d_out, d_final, **kw):
    def loss(*a):
        o, s = fn(*a, **kw)
        return jnp.sum(o * d_out) + jnp.sum(s * d_final)

    return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_gradients_match_numpy_reference_with_packing_and_padding(chunk_size):
    # T = 150 is not a multiple of either chunk size; groups 0 (reads the initial state), 1, 2 with
    # boundaries inside and across chunks.
    q, k, v, g, beta, s0 = make_inputs(4, B=2, T=150, H=2)
    groups = np.zeros((2, 150), np.int32)
    groups[0, 37:90], groups[0, 90:] = 1, 2
    groups[1, 64:] = 1
    d_out, d_final = _cotangents(5, q, v, s0)
    got = _grads(
        chunked_gated_delta_rule,
        (q, k, v, g, beta, s0),
        d_out,
        d_final,
        groups_BxT=groups,
        chunk_size=chunk_size,
    )
    want = numpy_forward_backward(q, k, v, g, beta, s0, groups, d_out, d_final)[2]
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == jnp.float32, name
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=2e-4, err_msg=name)


@pytest.mark.parametrize("form", [(4, True), (4, False), (1, True)])
def test_accelerator_forms_match_numpy_values_and_gradients(monkeypatch, form):
    """What accelerators run, here on CPU: several chunks per loop step (their state-independent work
    batched) and/or the w form (``w = T k_read`` before the sequential steps, ``T^T dv_new`` after
    them). Values, final state and all gradients against the float64 NumPy references, with packing
    and an initial state; 250 tokens in chunks of 16 (16 chunks: 4 blocks of 4, the last one padded)."""
    from tmax_jax.models.qwen35 import delta_rule

    monkeypatch.setattr(delta_rule, "_FORM_OVERRIDE", form)
    q, k, v, g, beta, s0 = make_inputs(14, B=2, T=250, H=2)
    groups = np.zeros((2, 250), np.int32)
    groups[0, 37:130], groups[0, 130:] = 1, 2
    groups[1, 64:] = 1
    # A fresh jit: the form is read when the call is traced.
    o, s = jax.jit(lambda *a: chunked_gated_delta_rule(*a, groups_BxT=groups, chunk_size=16))(
        q, k, v, g, beta, s0
    )
    ref_o, ref_s = numpy_delta_rule(q, k, v, g, beta, s0, groups)
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s, ref_s, atol=2e-5, rtol=1e-4)
    d_out, d_final = _cotangents(15, q, v, s0)
    got = _grads(
        chunked_gated_delta_rule, (q, k, v, g, beta, s0), d_out, d_final, groups_BxT=groups, chunk_size=16
    )
    want = numpy_forward_backward(q, k, v, g, beta, s0, groups, d_out, d_final)[2]
    for name, a, b in zip(NAMES, got, want):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=2e-4, err_msg=name)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_gradients_match_autodiff_of_the_recurrent_form(chunk_size):
    q, k, v, g, beta, s0 = make_inputs(6, B=1, T=100, H=2)
    d_out, d_final = _cotangents(7, q, v, s0)
    got = _grads(chunked_gated_delta_rule, (q, k, v, g, beta, s0), d_out, d_final, chunk_size=chunk_size)
    want = _grads(recurrent_gated_delta_rule, (q, k, v, g, beta, s0), d_out, d_final)
    for name, a, b in zip(NAMES, got, want):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=2e-4, err_msg=name)
    # Only the final state's cotangent (the prefill-into-cache path): still exact.
    got = _grads(chunked_gated_delta_rule, (q, k, v, g, beta, s0), 0 * d_out, d_final, chunk_size=chunk_size)
    want = numpy_forward_backward(q, k, v, g, beta, s0, None, 0 * d_out, d_final)[2]
    for name, a, b in zip(NAMES, got, want):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=2e-4, err_msg=name)


def test_pads_get_zero_gradients_and_leave_the_rest_unchanged():
    q, k, v, g, beta, s0 = make_inputs(8, B=1, T=80)
    n = 57
    g2, beta2, k2 = g.copy(), beta.copy(), k.copy()
    g2[:, n:], beta2[:, n:], k2[:, n:] = 0.0, 0.0, 0.0  # what deltanet.py gives padding tokens
    d_out, d_final = _cotangents(9, q, v, s0)
    d_out[:, n:] = 0.0  # pads' outputs are ignored by the loss
    got = _grads(chunked_gated_delta_rule, (q, k2, v, g2, beta2, s0), d_out, d_final, chunk_size=16)
    trim = _grads(
        chunked_gated_delta_rule,
        tuple(x[:, :n] for x in (q, k, v, g, beta)) + (s0,),
        d_out[:, :n],
        d_final,
        chunk_size=16,
    )
    for name, a, b in zip(NAMES, got, trim):
        np.testing.assert_allclose(
            a[:, :n] if name != "initial_state" else a, b, atol=2e-5, rtol=1e-4, err_msg=name
        )
    for name, a in zip(("q", "v"), (got[0], got[2])):
        np.testing.assert_array_equal(a[:, n:], 0.0, err_msg=name)


# Error bounds against float64 on the same (rounded) inputs, relative to the reference's largest
# value. "float32": every matmul in float32 (measured 2e-7 to 4e-7 for values, the bfloat16 gradients
# one rounding); "mixed": bfloat16 matmul operands with float32 accumulation and a float32 state
# (measured 2e-3 to 5.5e-3 for values and gradients: bfloat16's unit roundoff, 3.9e-3).
@pytest.mark.parametrize("policy, value_tol", [("float32", 2e-5), ("mixed", 1e-2)])
def test_bfloat16_inputs_give_float32_outputs_and_bfloat16_gradients(monkeypatch, policy, value_tol):
    monkeypatch.setenv("TMAX_JAX_PRECISION", policy)
    q, k, v, g, beta, s0 = make_inputs(10, B=1, T=96, H=2)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    rounded = [np.asarray(x.astype(jnp.float32)) for x in bf]  # the reference sees the same inputs
    # A fresh jit: the policy is read at trace time.
    o, s = jax.jit(chunked_gated_delta_rule, static_argnames="chunk_size")(*bf, g, beta, s0, chunk_size=16)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    ref_o, ref_s = numpy_delta_rule(*rounded, g, beta, s0)
    for got, ref in ((o, ref_o), (s, ref_s)):
        if policy == "float32":  # the state and the math stay float32
            np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)
        else:
            np.testing.assert_allclose(got, ref, atol=value_tol * np.abs(ref).max(), rtol=value_tol)
    d_out, d_final = _cotangents(11, q, v, s0)
    got = _grads(chunked_gated_delta_rule, (*bf, g, beta, s0), d_out, d_final, chunk_size=16)
    want = numpy_forward_backward(*rounded, g, beta, s0, None, d_out, d_final)[2]
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == (jnp.bfloat16 if name in "qkv" else jnp.float32), name
        # bfloat16 gradients: one rounding of the float32 result (8 bits of mantissa).
        np.testing.assert_allclose(
            np.asarray(a, np.float32), b, atol=1e-2 * np.abs(b).max(), rtol=1e-2, err_msg=name
        )


def test_saved_residuals_hold_inputs_and_one_state_per_chunk_only():
    # C = 16 differs from dk = 8 and dv = 6, so any [.., C, C] residual is recognisable.
    C, T = 16, 150
    q, k, v, g, beta, s0 = make_inputs(12, B=1, T=T, H=2)
    groups = np.zeros((1, T), np.int32)
    groups[0, 70:] = 1
    _, vjp_fn = jax.vjp(
        lambda *a: chunked_gated_delta_rule(*a, groups_BxT=groups, chunk_size=C), q, k, v, g, beta, s0
    )
    residuals = jax.tree.leaves(vjp_fn)
    assert not [r.shape for r in residuals if r.ndim >= 2 and r.shape[-2:] == (C, C)]
    n_chunks = -(-T // C)
    inputs = sum(x.size for x in (q, k, v, g, beta, s0, groups))
    states = n_chunks * s0.size
    assert sum(r.size for r in residuals) <= inputs + states
    # The states are there (float32), and the inputs are kept as they came, not as float32 copies.
    assert [r.dtype for r in residuals if r.size == states] == [jnp.float32]
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    _, vjp_fn = jax.vjp(lambda *a: chunked_gated_delta_rule(*a, chunk_size=C), *bf, g, beta, s0)
    assert sorted(str(r.dtype) for r in jax.tree.leaves(vjp_fn) if r.ndim == 4) == ["bfloat16"] * 3


def test_bad_shapes_are_rejected_with_the_name_of_the_input():
    q, k, v, g, beta, s0 = make_inputs(13, B=1, T=20)
    with pytest.raises(ValueError, match="beta"):
        chunked_gated_delta_rule(q, k, v, g, beta[:, :10])
    with pytest.raises(ValueError, match="initial_state"):
        chunked_gated_delta_rule(q, k, v, g, beta, s0[:, :, :3])
    with pytest.raises(ValueError, match="groups"):
        chunked_gated_delta_rule(q, k, v, g, beta, None, np.zeros((1, 19), np.int32))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=0)


@pytest.mark.parametrize("n", [1, 5, 16, 50, 64])
def test_blocked_unit_lower_inverse_matches_numpy(n):
    from tmax_jax.models.qwen35.delta_rule import _unit_lower_inverse

    # Sizes through the Neumann base case, the halving path and odd splits.
    lower = np.tril(np.random.default_rng(n).normal(size=(3, n, n)) * 0.3, -1)
    got = jax.jit(_unit_lower_inverse)(jnp.asarray(lower, jnp.float32))
    np.testing.assert_allclose(got, np.linalg.inv(np.eye(n) + lower), atol=1e-5, rtol=1e-5)


def test_unit_lower_inverse_on_keys_sharing_a_direction():
    """The UT transform's matrix when a chunk's keys are nearly parallel (trained models' keys often
    are) and beta ~ 1: its entries are O(1) and a power series of it loses digits fast."""
    from tmax_jax.models.qwen35.delta_rule import _unit_lower_inverse

    rng = np.random.default_rng(0)
    C = 64
    k = rng.normal(size=128)[None, None] + 0.05 * rng.normal(size=(4, C, 128))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -0.01 * np.arange(C)
    a = np.tril(0.99 * np.einsum("bik,bjk->bij", k, k) * np.exp(g[:, None] - g[None, :]), -1)
    a32 = a.astype(np.float32)
    want = np.linalg.inv(np.eye(C) + a32.astype(np.float64))
    got = np.asarray(jax.jit(_unit_lower_inverse)(jnp.asarray(a32)), np.float64)
    assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()
