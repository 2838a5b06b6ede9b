"""RSPO's router-shift ratio (arXiv 2510.23027) against hand-computed values, and its place in the
loss: it rescales each token's ratio before clipping, for token- and sequence-level objectives."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import Setup, minibatch, small, values

from gspo_jax import metrics
from gspo_jax.algorithms import ALGORITHMS
from gspo_jax.losses import LossConfig, LossWeights, policy_loss
from gspo_jax.mismatch import and_keep, geometric_mask, icepop_mask, off_policy_mask
from gspo_jax.router_shift import expert_logprobs, shift_weight

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def two_tokens():
    """[B=1, L=2, T=2, K=2] router log-probs: token 0 moved (Δ = log(2.5)/4), token 1 did not."""
    old = np.log(np.array([[[[0.5, 0.3], [0.2, 0.2]], [[0.6, 0.2], [0.1, 0.7]]]], np.float32))
    new = old.copy()
    new[0, 0, 0] = np.log([0.4, 0.3])  # |Δ| = log 1.25, 0: layer mean log(1.25)/2
    new[0, 1, 0] = np.log([0.6, 0.4])  # |Δ| = 0, log 2: layer mean log(2)/2
    return new, old


@JIT
def test_hand_computed_ratio_floor_and_metrics(jit):
    new, old = two_tokens()
    fn = jax.jit(shift_weight, static_argnums=3) if jit else shift_weight
    gamma0 = 2.5**-0.25  # exp(-(log(1.25)/2 + log(2)/2) / 2) = 0.7953
    low = fn(jnp.asarray(new), jnp.asarray(old), jnp.ones((1, 2), bool), 0.5)
    np.testing.assert_allclose(low.weight_BT, [[gamma0, 1.0]], rtol=1e-6)
    high = fn(jnp.asarray(new), jnp.asarray(old), jnp.ones((1, 2), bool), 0.8)  # the floor binds on token 0
    np.testing.assert_allclose(high.weight_BT, [[0.8, 1.0]], rtol=1e-6)
    m = metrics.compute(high.metrics)
    assert m["router_shift_mean"] == pytest.approx(0.9, rel=1e-6)
    assert m["router_shift_min"] == pytest.approx(0.8, rel=1e-6)
    assert m["router_shift_raw_mean"] == pytest.approx((gamma0 + 1) / 2, rel=1e-6)
    assert m["router_shift_floor_frac"] == pytest.approx(0.5)
    assert m["router_shift_deviation_mean"] == pytest.approx(math.log(2.5) / 8, rel=1e-5)
    only_still = metrics.compute(fn(jnp.asarray(new), jnp.asarray(old), jnp.array([[False, True]]), 0.8).metrics)
    assert only_still["router_shift_min"] == 1.0 and only_still["router_shift_floor_frac"] == 0.0


def test_expert_logprobs_are_the_full_softmax_at_the_chosen_experts():
    logits = np.log(np.array([1.0, 2.0, 3.0, 4.0], np.float32)) + 7.0  # softmax: .1 .2 .3 .4
    got = expert_logprobs(jnp.asarray(logits).reshape(1, 1, 1, 4), jnp.array([[[[3, 1]]]]))
    np.testing.assert_allclose(got[0, 0, 0], np.log([0.4, 0.2]), rtol=1e-6)


@JIT
def test_topk_probs_count_only_the_shares_within_pi_olds_experts(jit):
    """`probs="topk"` renormalises both routers over π_old's K experts: mass moving out of the set in
    proportion leaves γ = 1 (the full softmax's γ halves), shares moving within it count alike."""
    fn = jax.jit(shift_weight, static_argnums=(3, 4)) if jit else shift_weight
    old = np.log(np.array([[[[0.5, 0.3]]], [[[0.5, 0.3]]]], np.float32))  # [B=2, L=1, T=1, K=2]
    new = np.log(np.array([[[[0.25, 0.15]]], [[[0.3, 0.5]]]], np.float32))  # out of the set; swapped within
    mask = jnp.ones((2, 1), bool)
    soft = fn(jnp.asarray(new), jnp.asarray(old), mask, 0.1, "softmax")
    top = fn(jnp.asarray(new), jnp.asarray(old), mask, 0.1, "topk")
    np.testing.assert_allclose(soft.weight_BT, [[0.5], [0.6]], rtol=1e-6)  # exp(-log 2); exp(-log(5/3))
    np.testing.assert_allclose(top.weight_BT, [[1.0], [0.6]], rtol=1e-6)  # .625/.375 -> .375/.625: 3/5
    with pytest.raises(ValueError, match="probs must be one of"):
        shift_weight(jnp.asarray(new), jnp.asarray(old), mask, 0.1, "gates")
    with pytest.raises(ValueError, match="router_shift_probs"):
        LossConfig(router_shift=True, router_shift_probs="gates")


def test_the_weight_passes_no_gradient_and_is_one_without_moe_layers():
    new, old = two_tokens()
    g = jax.grad(lambda n: jnp.sum(shift_weight(n, jnp.asarray(old), jnp.ones((1, 2)), 0.5).weight_BT))(new)
    assert not np.any(np.asarray(g))
    dense = shift_weight(jnp.zeros((2, 0, 3, 2)), jnp.zeros((2, 0, 3, 2)), jnp.ones((2, 3)), 0.8)
    np.testing.assert_array_equal(dense.weight_BT, np.ones((2, 3)))


# ------------------------------------------------------------------ in the loss


def one_sequence(ratios, gammas):
    logp = jnp.asarray(np.log(np.array([ratios], np.float32)))
    return logp, jnp.zeros_like(logp), jnp.ones(1), jnp.ones_like(logp), jnp.asarray([gammas], jnp.float32)


def value_and_grad(cfg, logp, old, adv, mask, gamma=None):
    weights = LossWeights(router_shift=gamma)
    fn = lambda x: policy_loss(cfg, x, old, adv, mask, old - 0.1, weights=weights)  # ref: only with β > 0
    (loss, m), g = jax.value_and_grad(fn, has_aux=True)(logp)
    return float(loss), np.asarray(g[0]), metrics.compute(m)


def test_token_ratios_are_rescaled_before_the_clip():
    """r = 1.1, 1.4, 1.3 with γ̃ = .8, .9, .8 and A = 1: r̃ = .88 (unclipped), 1.26 (clipped at 1.2),
    1.04 (unclipped; r itself would be clipped): a weight after the clip would zero its gradient."""
    cfg = LossConfig(aggregation="token_mean")
    loss, g, m = value_and_grad(cfg, *one_sequence([1.1, 1.4, 1.3], [0.8, 0.9, 0.8]))
    assert loss == pytest.approx(-(0.88 + 1.2 + 1.04) / 3, rel=1e-6)
    np.testing.assert_allclose(g, [-0.88 / 3, 0.0, -1.04 / 3], rtol=1e-5)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["ratio_mean"] == pytest.approx((1.1 + 1.4 + 1.3) / 3, rel=1e-6)  # π_θ/π_old, not rescaled
    _, g_plain, m_plain = value_and_grad(cfg, *one_sequence([1.1, 1.4, 1.3], [0.8, 0.9, 0.8])[:4])
    np.testing.assert_allclose(g_plain, [-1.1 / 3, 0.0, 0.0], rtol=1e-5)
    assert m_plain["clip_frac"] == pytest.approx(2 / 3)


def test_sequence_ratio_is_the_geometric_mean_of_the_rescaled_token_ratios():
    """GSPO (ε = 0.2 to see the clip): s = (1.1·1.4·1.3)^⅓ = 1.260 is clipped; s̃ = s·(.8·.9·.8)^⅓ = 1.049 is
    not, and every token's gradient is −A·s̃/3."""
    cfg = LossConfig(ratio="sequence", aggregation="sequence", eps_low=0.2, eps_high=0.2)
    s_tilde = (1.1 * 1.4 * 1.3 * 0.8 * 0.9 * 0.8) ** (1 / 3)
    loss, g, m = value_and_grad(cfg, *one_sequence([1.1, 1.4, 1.3], [0.8, 0.9, 0.8]))
    assert loss == pytest.approx(-s_tilde, rel=1e-6)
    np.testing.assert_allclose(g, np.full(3, -s_tilde / 3), rtol=1e-5)
    assert m["seq_ratio_mean"] == pytest.approx(s_tilde, rel=1e-6) and m["seq_clip_frac"] == 0.0
    loss_p, g_p, m_p = value_and_grad(cfg, *one_sequence([1.1, 1.4, 1.3], [0.8, 0.9, 0.8])[:4])
    assert loss_p == pytest.approx(-1.2, rel=1e-6) and not g_p.any() and m_p["seq_clip_frac"] == 1.0
    # GSPO-token takes the same s̃ per token: equal value and gradient under seq_mean_token_mean
    token = LossConfig(ratio="sequence_token", eps_low=0.2, eps_high=0.2)
    loss_t, g_t, _ = value_and_grad(token, *one_sequence([1.1, 1.4, 1.3], [0.8, 0.9, 0.8]))
    assert loss_t == pytest.approx(-s_tilde, rel=1e-6)
    np.testing.assert_allclose(g_t, g, rtol=1e-5)


def test_gmpo_clips_the_rescaled_token_log_ratios():
    """GMPO (ε = 0.4 on Δ, A > 0): Δ = log 1.6 = 0.47 is log-clipped; log(1.6·0.8) = 0.25 is not."""
    cfg = ALGORITHMS["gmpo"].loss
    g_mean = (1.6 * 0.8 * 1.1 * 0.9) ** 0.5
    loss, g, m = value_and_grad(cfg, *one_sequence([1.6, 1.1], [0.8, 0.9]))
    assert loss == pytest.approx(-g_mean, rel=1e-6)
    np.testing.assert_allclose(g, np.full(2, -g_mean / 2), rtol=1e-5)
    assert m["clip_frac"] == 0.0
    _, g_plain, m_plain = value_and_grad(cfg, *one_sequence([1.6, 1.1], [0.8, 0.9])[:4])
    assert g_plain[0] == 0.0 and m_plain["clip_frac"] == pytest.approx(0.5)


@pytest.mark.parametrize("name", sorted(n for n in ALGORITHMS if n != "ppo"))
def test_a_weight_of_one_changes_nothing(name):
    """On-policy (π_old's router is π_θ's) γ̃ = 1 exactly: value, metrics and gradient are the plain loss's."""
    cfg = ALGORITHMS[name].loss_config(8)
    rng = np.random.default_rng(0)
    mask = jnp.asarray(rng.random((3, 8)) < 0.8)
    old = jnp.asarray(-rng.random((3, 8)), jnp.float32)
    logp = old + jnp.asarray(rng.normal(0, 0.1, (3, 8)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=3), jnp.float32)
    new_r, _ = two_tokens()
    ones = shift_weight(jnp.asarray(new_r), jnp.asarray(new_r), jnp.ones((1, 2)), 0.8).weight_BT
    gamma = jnp.broadcast_to(ones[:, :1], (3, 8))
    plain = value_and_grad(cfg, logp, old, adv, mask)
    shifted = value_and_grad(cfg, logp, old, adv, mask, gamma)
    assert shifted[0] == plain[0] and shifted[2] == plain[2]
    np.testing.assert_array_equal(shifted[1], plain[1])


# ------------------------------------------------------------------ in the trainer


def test_the_trainer_applies_the_router_shift_and_the_masks():
    """Off the on-policy path the batch carries π_old's router log-probs from its scoring forward: at
    θ = θ_old γ = 1; π_old's shifted by 0.5 nats on every expert gives D = 0.5, γ = e^-0.5 < 0.8, so every
    token weighs the floor. With IcePop, the geometric and the off-policy mask on too (bands narrow
    enough to bite on a sampler 0.02 nats off), the step's loss is `policy_loss` with γ̃ = 0.8 and the
    three masks, inside the unmasked denominator."""
    c = small("grpo")
    c.loss.update(router_shift=True, icepop=True, icepop_low=0.99, icepop_high=1.01)
    c.loss.update(geo_mask_delta=0.002, off_policy_mask_delta=0.0)
    s = Setup(c)
    assert s.programs.score_router is not None and not s.programs.on_policy
    batch = minibatch(s)
    noise = np.random.default_rng(1).normal(0, 0.02, batch.old_logp.shape).astype(np.float32)
    batch = batch.replace(sampler_logp=batch.old_logp + noise * np.asarray(batch.loss_mask))
    b2 = s.programs.batch_shardings.tokens
    logp, topk, old_router = s.programs.score_router(
        s.params, *jax.device_put((batch.tokens, batch.positions), b2), None
    )
    np.testing.assert_array_equal(topk, batch.topk)
    m = values(s.step(batch.replace(old_router_logp=old_router))[1])
    assert m["router_shift_mean"] == pytest.approx(1.0, abs=1e-6) and m["router_shift_deviation_mean"] < 1e-6
    m = values(s.step(batch.replace(old_router_logp=old_router + 0.5))[1])
    assert m["router_shift_mean"] == pytest.approx(0.8) and m["router_shift_floor_frac"] == 1.0
    assert m["router_shift_raw_mean"] == pytest.approx(math.exp(-0.5), rel=1e-4)
    # Renormalised over π_old's experts (`loss.router_shift_probs="topk"`) the same shift is no shift.
    c_top = c.copy_and_resolve_references()
    c_top.loss.router_shift_probs = "topk"
    m_top = values(Setup(c_top).step(batch.replace(old_router_logp=old_router + 0.5))[1])
    assert m_top["router_shift_mean"] == pytest.approx(1.0, abs=1e-5)
    args = (batch.old_logp, batch.sampler_logp, batch.loss_mask)
    keep_tok, icepop = icepop_mask(0.99, 1.01, *args)
    keep_seq, geo = geometric_mask(0.002, *args)
    keep_opsm, opsm = off_policy_mask(0.0, logp, batch.sampler_logp, batch.advantages, batch.loss_mask)
    for name, frac in (("icepop", icepop), ("geo", geo), ("opsm", opsm)):
        assert 0 < m[f"{name}_masked_frac"] < 1 and m[f"{name}_masked_frac"] == pytest.approx(
            float(frac[f"{name}_masked_frac"].compute())
        )
    keep = and_keep(and_keep(keep_tok, keep_seq), keep_opsm)
    gamma = jnp.full(batch.loss_mask.shape, 0.8)
    args = (batch.old_logp, batch.advantages, batch.loss_mask, batch.ref_logp)
    want = policy_loss(s.built.loss, logp, *args, weights=LossWeights(keep=keep, router_shift=gamma))[0]
    assert m["loss"] == pytest.approx(float(want), rel=1e-4)
    unmasked = policy_loss(s.built.loss, logp, *args, weights=LossWeights(router_shift=gamma))[0]
    assert float(want) != pytest.approx(float(unmasked), rel=1e-3)
