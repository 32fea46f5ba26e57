"""A float64 NumPy reference of the gated delta rule with its reverse pass written by hand: one
token at a time, shared by the JAX-path and the Pallas-kernel tests."""

import numpy as np


def numpy_forward_backward(q, k, v, g, beta, s0, groups, do, ds_final):
    """float64 token loop and its reverse pass, by hand. Returns (out, final, grads of q k v g beta s0).

    The state restarts from zero where the group changes (the initial state belongs to group 0), so
    no gradient crosses a group boundary.
    """
    q, k, v, g, beta, s0, do, ds_final = (
        np.asarray(x, np.float64) for x in (q, k, v, g, beta, s0, do, ds_final)
    )
    B, T, H, K = k.shape
    V = v.shape[-1]
    groups = np.zeros((B, T), np.int64) if groups is None else np.asarray(groups)
    out = np.zeros((B, T, H, V))
    final = np.zeros((B, H, K, V))
    grads = [np.zeros_like(x) for x in (q, k, v, g, beta, s0)]
    dq, dk, dv, dg, dbeta, ds0 = grads
    for b in range(B):
        s = s0[b].copy()
        tape = []  # (read state, decayed state, written state, error) per token
        for t in range(T):
            restart = groups[b, t] != (groups[b, t - 1] if t else 0)
            s_prev = np.zeros((H, K, V)) if restart else s
            s_a = s_prev * np.exp(g[b, t])[:, None, None]
            err = v[b, t] - np.einsum("hk,hkv->hv", k[b, t], s_a)
            s = s_a + k[b, t][:, :, None] * (beta[b, t][:, None] * err)[:, None, :]
            out[b, t] = np.einsum("hk,hkv->hv", q[b, t], s)
            tape.append((restart, s_a, s, err))
        final[b] = s
        ds = ds_final[b].copy()
        for t in reversed(range(T)):
            restart, s_a, s_t, err = tape[t]
            ds = ds + q[b, t][:, :, None] * do[b, t][:, None, :]
            dq[b, t] = np.einsum("hkv,hv->hk", s_t, do[b, t])
            d_delta = np.einsum("hkv,hk->hv", ds, k[b, t])
            dk[b, t] = np.einsum("hkv,hv->hk", ds, beta[b, t][:, None] * err)
            dv[b, t] = beta[b, t][:, None] * d_delta
            dbeta[b, t] = np.sum(d_delta * err, axis=-1)
            d_pred = -beta[b, t][:, None] * d_delta
            ds_a = ds + k[b, t][:, :, None] * d_pred[:, None, :]
            dk[b, t] += np.einsum("hkv,hv->hk", s_a, d_pred)
            dg[b, t] = np.sum(s_a * ds_a, axis=(1, 2))
            ds = np.zeros_like(ds) if restart else ds_a * np.exp(g[b, t])[:, None, None]
        ds0[b] = ds
    return out, final, grads
