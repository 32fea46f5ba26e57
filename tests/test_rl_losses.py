"""Every registered loss (DPPO, PPO-clip, GRPO, CISPO, SFT) and the off-policy corrections against
NumPy float64 references written here (value and gradient), and the mismatch / staleness statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.rl import LossConfig, LossInputError, dppo_loss, policy_loss
from tmax_jax.rl.losses import LOSSES, get_loss

pytestmark = pytest.mark.strict_ranks


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


# -- the registry, the new losses and the off-policy corrections -------------------------------------


def per_token_case(seed, spread=0.6):
    lp, mu_lp, adv, mask = make_case(seed, spread=spread)
    rng = np.random.default_rng(seed + 1)
    a = rng.normal(size=lp.shape).astype(np.float32)
    return lp, mu_lp, a, mask


def value_and_grad(cfg, lp, mu_lp, a, mask, seg=None, lag=None):
    def f(x):
        return policy_loss(
            cfg,
            x,
            jnp.asarray(mu_lp),
            jnp.asarray(a),
            jnp.asarray(mask),
            None if seg is None else jnp.asarray(seg),
            None if lag is None else jnp.asarray(lag),
        )

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    return float(loss), np.asarray(grad), metrics


def test_registry_has_every_loss_and_rejects_unknown_names():
    assert set(LOSSES) == {"dppo", "grpo", "ppo_clip", "cispo", "sft"}
    with pytest.raises(LossInputError, match="loss name must be one of"):
        get_loss("dpo")
    with pytest.raises(ConfigError, match="loss.name must be one of"):
        LossConfig(name="dpo")


def test_dppo_separate_low_and_high_thresholds_match_numpy():
    lp, mu_lp, a, mask = per_token_case(3, spread=1.0)
    lo, hi = 0.05, 0.25
    r = np.exp(lp.astype(np.float64) - mu_lp)
    d = np.abs(np.exp(lp.astype(np.float64)) - np.exp(mu_lp.astype(np.float64)))
    bad = ((d > hi) & (a > 0) & (r > 1)) | ((d > lo) & (a < 0) & (r < 1))
    keep = (~bad) * mask
    n = mask.sum()
    loss, grad, m = value_and_grad(LossConfig(delta=lo, delta_high=hi), lp, mu_lp, a, mask)
    np.testing.assert_allclose(loss, np.sum(-a * r * keep) / n, rtol=2e-5)
    np.testing.assert_allclose(grad, -a * r * keep / n, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(float(m["masked_fraction"]), (bad * mask).sum() / n, rtol=1e-6)
    # The two thresholds really differ on this case (one-threshold DPPO masks something else).
    only_lo = ((d > lo) & (((a > 0) & (r > 1)) | ((a < 0) & (r < 1)))) * mask
    assert only_lo.sum() > (bad * mask).sum()


def test_cispo_matches_numpy():
    lp, mu_lp, a, mask = per_token_case(5)
    eps_high = 0.3
    r = np.exp(lp.astype(np.float64) - mu_lp)
    w = np.minimum(r, 1 + eps_high)
    n = mask.sum()
    loss, grad, m = value_and_grad(LossConfig(name="cispo", clip_eps_high=eps_high), lp, mu_lp, a, mask)
    np.testing.assert_allclose(loss, np.sum(-w * a * lp * mask) / n, rtol=2e-5)
    np.testing.assert_allclose(grad, -w * a * mask / n, rtol=2e-5, atol=1e-7)  # d log pi / d lp = 1
    np.testing.assert_allclose(float(m["masked_fraction"]), ((r > 1 + eps_high) * mask).sum() / n, rtol=1e-6)
    assert 0 < float(m["masked_fraction"]) < 1


def test_sft_is_the_token_nll():
    lp, mu_lp, a, mask = per_token_case(7)
    n = mask.sum()
    loss, grad, m = value_and_grad(LossConfig(name="sft"), lp, mu_lp, a, mask)
    np.testing.assert_allclose(loss, -np.sum(lp.astype(np.float64) * mask) / n, rtol=2e-6)
    np.testing.assert_allclose(grad, -mask / n, rtol=1e-6)
    np.testing.assert_allclose(
        float(m["token_prob_mean"]), (np.exp(lp.astype(np.float64)) * mask).sum() / n, rtol=1e-5
    )
    # Neither the advantages nor the rollout logprobs matter.
    loss2, _, _ = value_and_grad(LossConfig(name="sft"), lp, mu_lp * 0 - 3.0, -a, mask)
    assert loss2 == loss


@pytest.mark.parametrize("name", ["dppo", "ppo_clip"])
def test_token_level_tis_caps_the_gradient_weight(name):
    lp, mu_lp, a, mask = per_token_case(9, spread=0.8)
    cap = 1.5
    r = np.exp(lp.astype(np.float64) - mu_lp)
    n = mask.sum()
    base_loss, base_grad, _ = value_and_grad(LossConfig(name=name, delta=0.3), lp, mu_lp, a, mask)
    loss, grad, m = value_and_grad(LossConfig(name=name, delta=0.3, tis_cap=cap), lp, mu_lp, a, mask)
    # Per token, the gradient's weight r becomes min(r, cap): the uncorrected gradient times min(r, C)/r.
    w = np.minimum(r, cap) / r
    np.testing.assert_allclose(grad, base_grad * w, rtol=3e-5, atol=1e-7)
    if name == "dppo":
        d = np.abs(np.exp(lp.astype(np.float64)) - np.exp(mu_lp.astype(np.float64)))
        bad = (d > 0.3) & (((a > 0) & (r > 1)) | ((a < 0) & (r < 1)))
        np.testing.assert_allclose(loss, np.sum(-a * np.minimum(r, cap) * (~bad) * mask) / n, rtol=2e-5)
    np.testing.assert_allclose(float(m["tis_capped_fraction"]), ((r > cap) * mask).sum() / n, rtol=1e-6)
    assert float(m["tis_capped_fraction"]) > 0 and loss != base_loss


def test_tis_is_rejected_for_losses_without_an_importance_weight():
    for name in ("cispo", "sft"):
        with pytest.raises(ConfigError, match="tis_cap does not apply"):
            LossConfig(name=name, tis_cap=2.0)
    for bad, match in [
        (dict(tis_cap=0.5), "tis_cap must be >= 1"),
        (dict(tis_cap=-1.0), "tis_cap must be a number > 0"),
        (dict(seq_mask_low=1.2), "seq_mask_low must be <= 1"),
        (dict(seq_mask_high=0.9), "seq_mask_high must be >= 1"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(delta_high=-0.1), "delta"),
    ]:
        with pytest.raises(ConfigError, match=match):
            LossConfig(**bad)
    d = LossConfig()  # TMAX's recipe: DPPO TV 0.1, no corrections
    assert (d.name, d.divergence, d.delta, d.delta_high, d.tis_cap, d.seq_mask_low, d.seq_mask_high) == (
        "dppo",
        "tv",
        0.1,
        None,
        None,
        None,
        None,
    )
    assert not d.truncated


def test_train_config_refuses_a_loss_truncation_other_than_the_rollouts():
    from tmax_jax.config import override
    from tmax_jax.train.config import TrainConfig

    for bad in (
        {"top_p": 0.9},  # the engine samples (and reports logprobs) truncated, the loss does not
        {"rl": {"loss": {"top_k": 20}}},  # the loss truncates, the engine does not
        {"top_k": 20, "rl": {"loss": {"top_k": 10}}},
    ):
        with pytest.raises(ConfigError, match=r"rl\.loss\.top_k / rl\.loss\.top_p .* rollout sampling"):
            override(TrainConfig(), bad)
    ok = override(TrainConfig(), {"top_k": 20, "top_p": 0.9, "rl": {"loss": {"top_k": 20, "top_p": 0.9}}})
    assert ok.rl.loss.truncated and (ok.top_k, ok.top_p) == (20, 0.9)


def test_sequence_masking_drops_whole_sequences_by_geometric_mean_ratio():
    lp, mu_lp, _, mask = make_case(21, B=3, T=10, spread=0.5)
    mask[-1] = 1.0
    seg = np.array([[1] * 4 + [2] * 6, [1] * 10, [1] * 3 + [2] * 3 + [3] * 4], np.int32)
    rng = np.random.default_rng(2)
    a = rng.normal(size=lp.shape).astype(np.float32)
    lo, hi = 0.8, 1.25
    keep_seq = np.zeros_like(mask)
    geos = []
    for b in range(3):
        for s in np.unique(seg[b]):
            sel = (seg[b] == s) & (mask[b] > 0)
            if not sel.any():
                continue
            geo = np.exp(np.mean(lp[b][sel].astype(np.float64) - mu_lp[b][sel]))
            geos.append(geo)
            keep_seq[b][seg[b] == s] = float(lo <= geo <= hi)
    assert min(geos) < lo or max(geos) > hi  # the case drops something ...
    assert any(lo <= g <= hi for g in geos)  # ... and keeps something
    r = np.exp(lp.astype(np.float64) - mu_lp)
    d = np.abs(np.exp(lp.astype(np.float64)) - np.exp(mu_lp.astype(np.float64)))
    bad = (d > 0.1) & (((a > 0) & (r > 1)) | ((a < 0) & (r < 1)))
    keep = (~bad) * mask * keep_seq
    n = mask.sum()  # dropped tokens still count in the normaliser, like DPPO's masked ones
    cfg = LossConfig(seq_mask_low=lo, seq_mask_high=hi)
    loss, grad, m = value_and_grad(cfg, lp, mu_lp, a, mask, seg)
    np.testing.assert_allclose(loss, np.sum(-a * r * keep) / n, rtol=2e-5)
    np.testing.assert_allclose(grad, -a * r * keep / n, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(float(m["seq_masked_fraction"]), (mask * (1 - keep_seq)).sum() / n, rtol=1e-6)


def test_mismatch_and_staleness_statistics_match_numpy():
    lp, mu_lp, a, mask = per_token_case(23, spread=0.3)
    rng = np.random.default_rng(4)
    lag = rng.choice([-1, 0, 0, 1, 2, 5], size=lp.shape).astype(np.int32)
    _, _, m = value_and_grad(LossConfig(), lp, mu_lp, a, mask, lag=lag)
    x, mu = lp.astype(np.float64), mu_lp.astype(np.float64)
    same = (mask > 0) & (lag == 0)
    known = (mask > 0) & (lag >= 0)
    diff = np.abs(x - mu)
    log_r = x - mu
    np.testing.assert_allclose(float(m["mismatch/tokens"]), same.sum())
    np.testing.assert_allclose(float(m["mismatch/max_abs_logprob_diff"]), diff[same].max(), rtol=1e-6)
    np.testing.assert_allclose(float(m["mismatch/mean_abs_logprob_diff"]), diff[same].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["mismatch/kl"]), (np.expm1(log_r) - log_r)[same].mean(), rtol=1e-4)
    np.testing.assert_allclose(
        float(m["staleness/off_policy_fraction"]), (known & (lag > 0)).sum() / known.sum()
    )
    for label, sel in [("0", lag == 0), ("1", lag == 1), ("2", lag == 2), ("3+", lag >= 3)]:
        np.testing.assert_allclose(
            float(m[f"staleness/lag_{label}_fraction"]), (known & sel).sum() / known.sum()
        )
    # Without lags the step reports no mismatch / staleness numbers at all.
    _, _, plain = value_and_grad(LossConfig(), lp, mu_lp, a, mask)
    assert not any(k.startswith(("mismatch/", "staleness/")) for k in plain)
