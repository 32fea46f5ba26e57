"""DPPO / PPO-clip / GRPO against NumPy references written here (value and gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.rl import LossConfig, LossInputError, dppo_loss, policy_loss


def np_dppo(lp, mu_lp, adv, mask, delta, divergence):
    """Reference in float64: returns loss, d loss / d lp, masked-token boolean."""
    lp, mu_lp = lp.astype(np.float64), mu_lp.astype(np.float64)
    pi, mu = np.exp(lp), np.exp(mu_lp)
    r = np.exp(lp - mu_lp)
    if divergence == "tv":
        d = np.abs(pi - mu)
    else:
        d = mu * np.log(mu / pi) + (1 - mu) * np.log((1 - mu) / (1 - pi))
    a = np.broadcast_to(adv[:, None], lp.shape)
    bad = (d > delta) & (((a > 0) & (r > 1)) | ((a < 0) & (r < 1)))
    m = (~bad) * mask
    n = max(mask.sum(), 1.0)
    loss = np.sum(-a * r * m) / n
    grad = -a * r * m / n  # d r / d lp = r
    return loss, grad, bad & (mask > 0), d


def make_case(seed, B=5, T=12, spread=1.5):
    rng = np.random.default_rng(seed)
    mu_lp = np.log(rng.uniform(0.02, 0.97, size=(B, T)))
    lp = np.minimum(mu_lp + rng.normal(0, spread, size=(B, T)), -1e-3)
    adv = rng.normal(0, 1, size=B)
    adv[1] = 0.0  # a zero-advantage row
    mask = (rng.uniform(size=(B, T)) > 0.3).astype(np.float32)
    mask[:, :2] = 0  # prompt tokens
    mask[-1] = 0  # an all-padding row
    return lp.astype(np.float32), mu_lp.astype(np.float32), adv.astype(np.float32), mask


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("delta", [0.0, 0.05, 0.1, 0.3, 10.0])
def test_dppo_value_and_grad_match_numpy(divergence, delta):
    # First seed whose divergences stay clear of float32 rounding right at the threshold.
    for seed in range(100):
        lp, mu_lp, adv, mask = make_case(seed)
        ref_loss, ref_grad, ref_bad, d = np_dppo(lp, mu_lp, adv, mask, delta, divergence)
        if np.all(np.abs(d - delta)[mask > 0] > 1e-5):
            break

    def f(x):
        return dppo_loss(
            x, jnp.asarray(mu_lp), jnp.asarray(adv), jnp.asarray(mask), delta=delta, divergence=divergence
        )

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=2e-5, atol=1e-7)
    n = mask.sum()
    np.testing.assert_allclose(float(metrics["masked_fraction"]), ref_bad.sum() / n, rtol=1e-6)
    a = np.broadcast_to(adv[:, None], lp.shape)
    np.testing.assert_allclose(
        float(metrics["masked_fraction_pos_adv"]), (ref_bad & (a > 0)).sum() / n, rtol=1e-6
    )
    np.testing.assert_allclose(
        float(metrics["masked_fraction_neg_adv"]), (ref_bad & (a < 0)).sum() / n, rtol=1e-6
    )
    r = np.exp(lp.astype(np.float64) - mu_lp)
    np.testing.assert_allclose(float(metrics["ratio_mean"]), (r * mask).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(
        float(metrics["max_abs_logprob_diff"]), np.abs(lp - mu_lp)[mask > 0].max(), rtol=1e-6
    )
    if delta == 0.0:
        assert ref_bad.any() and (~ref_bad & (mask > 0)).any()  # the case really masks and keeps tokens
    if delta == 10.0:
        assert not ref_bad.any()


def test_dppo_masks_only_tokens_moving_away_from_one():
    mu_lp = jnp.log(jnp.array([[0.5, 0.5, 0.5, 0.5]], jnp.float32))
    lp = jnp.log(jnp.array([[0.9, 0.1, 0.9, 0.1]], jnp.float32))  # |pi - mu| = 0.4 everywhere
    mask = jnp.ones((1, 4), jnp.float32)
    _, pos = dppo_loss(lp, mu_lp, jnp.array([1.0]), mask, delta=0.1)
    _, neg = dppo_loss(lp, mu_lp, jnp.array([-1.0]), mask, delta=0.1)
    # A > 0: tokens with r > 1 (0.9 / 0.5) are masked; A < 0: tokens with r < 1.
    assert float(pos["masked_fraction_pos_adv"]) == 0.5 and float(pos["masked_fraction_neg_adv"]) == 0.0
    assert float(neg["masked_fraction_neg_adv"]) == 0.5 and float(neg["masked_fraction_pos_adv"]) == 0.0


def test_dppo_all_padding_batch_is_zero_and_finite():
    z = jnp.zeros((2, 3), jnp.float32)
    loss, metrics = dppo_loss(z - 1.0, z - 1.0, jnp.ones(2), z)
    assert float(loss) == 0.0 and all(np.isfinite(float(v)) for v in metrics.values())


def test_dppo_kl_finite_at_probability_one():
    lp = jnp.zeros((1, 2), jnp.float32)  # pi = 1 exactly
    loss, metrics = dppo_loss(
        lp, jnp.log(jnp.array([[1.0, 0.5]])), jnp.ones(1), jnp.ones((1, 2)), divergence="kl"
    )
    assert np.isfinite(float(loss)) and np.isfinite(float(metrics["divergence_mean"]))


def test_dppo_jits():
    lp, mu_lp, adv, mask = make_case(7)
    ref, _, _, _ = np_dppo(lp, mu_lp, adv, mask, 0.1, "tv")
    loss, _ = jax.jit(lambda *a: dppo_loss(*a, delta=0.1))(lp, mu_lp, adv, mask)
    np.testing.assert_allclose(float(loss), ref, rtol=2e-5)


@pytest.mark.parametrize(
    "args, match",
    [
        (
            (
                np.zeros((2, 3), np.float32),
                np.zeros((2, 4), np.float32),
                np.zeros(2, np.float32),
                np.ones((2, 3)),
            ),
            "rollout_logprobs",
        ),
        (
            (
                np.zeros((2, 3), np.float16),
                np.zeros((2, 3), np.float32),
                np.zeros(2, np.float32),
                np.ones((2, 3)),
            ),
            "logprobs must be float32",
        ),
        (
            (
                np.zeros((2, 3), np.float32),
                np.zeros((2, 3), np.float32),
                np.zeros((2, 3), np.float32),
                np.ones((2, 3)),
            ),
            "advantages must be",
        ),
        (
            (
                np.zeros((2, 3), np.float32),
                np.zeros((2, 3), np.float32),
                np.zeros(2, np.int32),
                np.ones((2, 3)),
            ),
            "advantages must be floating",
        ),
        (
            (np.zeros(3, np.float32), np.zeros((2, 3), np.float32), np.zeros(2, np.float32), np.ones((2, 3))),
            r"logprobs must be \[B, T\]",
        ),
        (
            (
                np.zeros((2, 3), np.float32),
                np.zeros((2, 3), np.float32),
                np.zeros(2, np.float32),
                np.ones((3, 3)),
            ),
            "response_mask",
        ),
    ],
)
def test_dppo_rejects_bad_inputs(args, match):
    with pytest.raises(LossInputError, match=match):
        dppo_loss(*map(jnp.asarray, args))


def test_dppo_rejects_unknown_divergence():
    z = jnp.zeros((1, 2), jnp.float32)
    with pytest.raises(LossInputError, match="divergence"):
        dppo_loss(z, z, jnp.zeros(1), z, divergence="js")


def np_clip_terms(lp, mu_lp, a, mask, eps):
    r = np.exp(lp.astype(np.float64) - mu_lp)
    un, cl = r * a, np.clip(r, 1 - eps, 1 + eps) * a
    per_tok = -np.minimum(un, cl)
    # Gradient flows only where the unclipped term is the minimum.
    grad_tok = np.where(un <= cl, -a * r, 0.0)
    return per_tok, grad_tok


def test_ppo_clip_matches_numpy():
    lp, mu_lp, adv, mask = make_case(11, spread=0.4)
    a = np.broadcast_to(adv[:, None], lp.shape).astype(np.float32)
    per_tok, grad_tok = np_clip_terms(lp, mu_lp, a, mask, 0.2)
    n = mask.sum()
    cfg = LossConfig(name="ppo_clip", clip_eps=0.2)
    f = lambda x: policy_loss(cfg, x, jnp.asarray(mu_lp), jnp.asarray(a), jnp.asarray(mask))
    (loss, _), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    np.testing.assert_allclose(float(loss), (per_tok * mask).sum() / n, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(grad), grad_tok * mask / n, rtol=2e-5, atol=1e-7)


def test_grpo_averages_per_packed_sequence():
    lp, mu_lp, _, mask = make_case(13, B=3, T=10, spread=0.4)
    mask[-1] = 1.0
    seg = np.array([[1] * 4 + [2] * 6, [1] * 10, [1] * 3 + [2] * 3 + [3] * 2 + [0] * 2], np.int32)
    mask[2, 8:] = 0  # padding
    rng = np.random.default_rng(0)
    a = rng.normal(size=lp.shape).astype(np.float32)
    per_tok, grad_tok = np_clip_terms(lp, mu_lp, a, mask, 0.2)
    ref_loss, ref_grad, n_seq = 0.0, np.zeros_like(grad_tok), 0
    for b in range(3):
        for s in np.unique(seg[b]):
            sel = (seg[b] == s) & (mask[b] > 0)
            if s == 0 or not sel.any():
                continue
            n_seq += 1
            ref_loss += per_tok[b][sel].mean()
            ref_grad[b][sel] = grad_tok[b][sel] / sel.sum()
    cfg = LossConfig(name="grpo", clip_eps=0.2)
    f = lambda x: policy_loss(cfg, x, jnp.asarray(mu_lp), jnp.asarray(a), jnp.asarray(mask), jnp.asarray(seg))
    (loss, _), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    np.testing.assert_allclose(float(loss), ref_loss / n_seq, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad / n_seq, rtol=2e-5, atol=1e-7)


def test_policy_loss_dppo_equals_public_api():
    lp, mu_lp, adv, mask = make_case(17)
    a = np.broadcast_to(adv[:, None], lp.shape).astype(np.float32)
    want, _ = dppo_loss(
        jnp.asarray(lp), jnp.asarray(mu_lp), jnp.asarray(adv), jnp.asarray(mask), delta=0.2, divergence="kl"
    )
    got, _ = policy_loss(
        LossConfig(delta=0.2, divergence="kl"),
        jnp.asarray(lp),
        jnp.asarray(mu_lp),
        jnp.asarray(a),
        jnp.asarray(mask),
    )
    assert float(got) == float(want)
