"""Sampler–trainer mismatch metrics: identities and hand-computed values, jitted and eager."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.losses import LossConfig, LossWeights, policy_loss
from gspo_jax.mismatch import (
    correction,
    corrections,
    geometric_mask,
    icepop_mask,
    mismatch_metrics,
    off_policy_mask,
)

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def call(jit, *args):
    fn = jax.jit(mismatch_metrics) if jit else mismatch_metrics
    return {k: float(v) for k, v in fn(*map(jnp.asarray, args)).items()}


def routing(B=2, L=3, T=4, K=2):
    return np.broadcast_to(np.array([0, 1], np.int32), (B, L, T, K)).copy()


@JIT
def test_identical_sampler_and_trainer_show_no_mismatch(jit):
    logp = -np.random.default_rng(0).random((2, 4)).astype(np.float32)
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool)
    out = call(jit, logp, logp, mask, routing(), routing())
    assert out == dict.fromkeys(out, 0.0)


@JIT
def test_hand_computed_values(jit):
    sampler = np.zeros((2, 4), np.float32)
    trainer = np.array([[math.log(3), -math.log(4), 0.1, 5.0], [0, 0, 0, 0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [0, 0, 0, 0]], bool)  # the 5.0 is off the mask: ignored
    sampler_topk, trainer_topk = routing(), routing()
    trainer_topk[0, 1, 0] = [0, 2]  # token (0, 0) flips in layer 1 of 3
    trainer_topk[0, 2, 2] = [3, 2]  # token (0, 2) flips in layer 2
    trainer_topk[1, :, 0] = [5, 6]  # off the mask: ignored
    out = call(jit, sampler, trainer, mask, sampler_topk, trainer_topk)
    k3 = [(3 - math.log(3) - 1), (0.25 + math.log(4) - 1), (math.exp(0.1) - 0.1 - 1)]
    assert out["kl_k3"] == pytest.approx(sum(k3) / 3, rel=1e-5)
    assert out["logp_abs_mean"] == pytest.approx((math.log(3) + math.log(4) + 0.1) / 3, rel=1e-5)
    assert out["logp_abs_max"] == pytest.approx(math.log(4), rel=1e-6)
    assert out["ratio_above_2"] == pytest.approx(1 / 3) and out["ratio_below_half"] == pytest.approx(1 / 3)
    assert out["router_flip_rate"] == pytest.approx(2 / 9)  # 2 of 3 tokens × 3 layers
    assert out["token_any_flip"] == pytest.approx(2 / 3)


@JIT
def test_no_completion_tokens_give_zeros_not_nan(jit):
    logp = np.full((2, 4), -1.0, np.float32)
    out = call(jit, logp, logp + 3.0, np.zeros((2, 4), bool), routing(), routing() + 1)
    assert out == dict.fromkeys(out, 0.0)


def test_log_ratios_are_clamped_before_exp_but_the_max_is_not():
    out = call(
        False,
        np.zeros((1, 2), np.float32),
        np.array([[200.0, 0.0]], np.float32),
        np.ones((1, 2), bool),
        routing(1, T=2),
        routing(1, T=2),
    )
    assert math.isfinite(out["kl_k3"]) and out["logp_abs_max"] == 200.0
    assert out["kl_k3"] == pytest.approx((math.expm1(20.0) - 20.0) / 2, rel=1e-5)


# ------------------------------------------------------------------ corrections: TIS and MIS


def _correct(jit, kind, level, cap, old, sampler, mask):
    fn = functools.partial(correction, kind, level, cap)
    c = (jax.jit(fn) if jit else fn)(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask))
    w = None if c.weight is None else np.asarray(c.weight)
    return w, np.asarray(c.mask_BT), {k: float(m.compute()) for k, m in c.metrics.items()}


@JIT
@pytest.mark.parametrize("kind", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_equal_log_probs_make_every_correction_the_identity(jit, kind, level):
    rng = np.random.default_rng(1)
    logp = -rng.random((3, 5)).astype(np.float32)
    mask = rng.random((3, 5)) < 0.7
    w, keep, metrics = _correct(jit, kind, level, 2.0, logp, logp, mask)
    assert w is None or np.all(w == 1.0)
    np.testing.assert_array_equal(keep, mask)
    assert metrics == {"is_weight_mean": 1.0, "is_cut_frac": 0.0}
    objectives = [LossConfig(is_correction=kind, is_level=level)]  # token ratios take either weight
    if level == "sequence":  # one loss per sequence: sequence weights only
        objectives.append(LossConfig(ratio="sequence", aggregation="sequence", is_correction=kind, is_level=level))
    new = jnp.asarray(logp + 0.1 * rng.normal(size=logp.shape).astype(np.float32))
    adv = rng.normal(size=3).astype(np.float32)
    weights = LossWeights(is_weight=w)
    for cfg in objectives:
        plain = jax.value_and_grad(lambda x, cfg=cfg: policy_loss(cfg, x, logp, adv, mask)[0])(new)
        fixed = jax.value_and_grad(lambda x, cfg=cfg: policy_loss(cfg, x, logp, adv, keep, weights=weights)[0])(new)
        np.testing.assert_allclose(fixed[0], plain[0], rtol=1e-6)
        np.testing.assert_allclose(fixed[1], plain[1], rtol=1e-6)


@JIT
def test_hand_computed_weights_and_masks(jit):
    sampler = np.zeros((1, 4), np.float32)
    old = np.array([[math.log(3), -math.log(4), 0.1, 9.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], bool)
    w, keep, m = _correct(jit, "tis", "token", 2.0, old, sampler, mask)
    np.testing.assert_allclose(w[0, :3], [2.0, 0.25, math.exp(0.1)], rtol=1e-6)
    np.testing.assert_array_equal(keep, mask)
    assert m["is_cut_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_mean"] == pytest.approx((3 + 0.25 + math.exp(0.1)) / 3, rel=1e-6)
    w, keep, m = _correct(jit, "mis", "token", 2.0, old, sampler, mask)
    assert w is None and keep.tolist() == [[False, False, True, False]] and m["is_cut_frac"] == pytest.approx(2 / 3)
    seq_w = 0.75 * math.exp(0.1)  # Π_t w_t = 3 · 1/4 · e^0.1, inside [1/2, 2]
    w, keep, m = _correct(jit, "tis", "sequence", 2.0, old, sampler, mask)
    np.testing.assert_allclose(w, [seq_w], rtol=1e-6)
    assert m == {"is_weight_mean": pytest.approx(seq_w, rel=1e-6), "is_cut_frac": 0.0}
    w, keep, m = _correct(jit, "mis", "sequence", 1.2, old, sampler, mask)  # 1/1.2 > 0.829: dropped whole
    assert not keep.any() and m["is_cut_frac"] == 1.0
    w, keep, m = _correct(jit, "tis", "sequence", 1.2, -old, sampler, mask)  # 1/0.829 > 1.2: truncated
    np.testing.assert_allclose(w, [1.2], rtol=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_corrections_over_random_masks(seed):
    """MIS keeps a subset of the mask; TIS weights lie in (0, C]; nothing off the mask matters; a
    uniform TIS weight c scales the policy loss and its gradient by c."""
    rng = np.random.default_rng(seed)
    B, T, cap = 4, 6, 1.5
    mask = rng.random((B, T)) < 0.6
    old, sampler = (rng.normal(0, 0.5, (B, T)).astype(np.float32) for _ in range(2))
    junk = np.where(mask, sampler, 99.0).astype(np.float32)
    for level in ("token", "sequence"):
        w, keep, m = _correct(False, "tis", level, cap, old, sampler, mask)
        assert np.all((w > 0) & (w <= cap + 1e-6))
        w2, _, m2 = _correct(False, "tis", level, cap, old, junk, mask)
        np.testing.assert_array_equal(w[mask] if level == "token" else w, w2[mask] if level == "token" else w2)
        assert m == m2
        _, keep, _ = _correct(False, "mis", level, cap, old, sampler, mask)
        assert not np.any(keep & ~mask)
    adv = rng.normal(size=B).astype(np.float32)
    cfg = LossConfig()
    loss = lambda x, w=None: policy_loss(cfg, x, old, adv, mask, weights=LossWeights(w))[1]["policy_loss"].total
    new = jnp.asarray(old + 0.05)
    for w in (np.full((B, T), 0.7, np.float32), np.full((B,), 0.7, np.float32)):
        np.testing.assert_allclose(loss(new, w), 0.7 * loss(new), rtol=1e-6)
        np.testing.assert_allclose(jax.grad(loss)(new, w), 0.7 * jax.grad(loss)(new), rtol=1e-5)


def test_bad_correction_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="is_correction"):
        LossConfig(is_correction="ppo")
    with pytest.raises(ValueError, match="is_cap"):
        LossConfig(is_correction="tis", is_cap=1.0)
    with pytest.raises(ValueError, match="is_level"):  # one loss per sequence: a token weight cannot apply
        LossConfig(ratio="sequence", aggregation="sequence", is_correction="tis", is_level="token")
    with pytest.raises(ValueError, match="is_weight"):
        gspo = LossConfig(ratio="sequence", aggregation="sequence")
        token_weight = LossWeights(is_weight=np.ones((2, 3)))
        policy_loss(gspo, np.zeros((2, 3)), np.zeros((2, 3)), np.ones(2), np.ones((2, 3)), weights=token_weight)


# ------------------------------------------------------------------ masks: IcePop, geometric, off-policy


def _frac(m, name):
    return float(m[name].compute())


@JIT
def test_icepop_masks_tokens_outside_its_band(jit):
    """w = 0.45 and 5.5 leave [0.5, 5]; 0.55 and 4.9 stay; off the mask nothing counts."""
    old = np.log(np.array([[0.45, 0.55, 4.9, 5.5, 100.0]], np.float32))
    mask = np.array([[1, 1, 1, 1, 0]], bool)
    fn = functools.partial(icepop_mask, 0.5, 5.0)
    keep, m = (jax.jit(fn) if jit else fn)(jnp.asarray(old), jnp.zeros((1, 5)), jnp.asarray(mask))
    assert np.asarray(keep).tolist() == [[False, True, True, False, True]]
    assert _frac(m, "icepop_masked_frac") == pytest.approx(0.5)


@JIT
def test_geometric_mask_drops_completions_whose_mean_ratio_leaves_the_band(jit):
    """δ = 0.01: √1.03 = 1.0149 leaves [0.99, 1.01]; √(1.01·0.995) = 1.0025 stays; an empty row is not
    counted; the value past the mask is ignored."""
    old = np.log(np.array([[1.03, 1.0, 9.0], [1.01, 0.995, 9.0], [9.0, 9.0, 9.0]], np.float32))
    mask = np.array([[1, 1, 0], [1, 1, 0], [0, 0, 0]], bool)
    fn = functools.partial(geometric_mask, 0.01)
    keep, m = (jax.jit(fn) if jit else fn)(jnp.asarray(old), jnp.zeros((3, 3)), jnp.asarray(mask))
    assert np.asarray(keep).tolist() == [False, True, True]
    assert _frac(m, "geo_masked_frac") == pytest.approx(0.5)


@JIT
def test_off_policy_mask_drops_negative_advantage_completions_far_from_the_sampler(jit):
    """Mean of log π_sampler − log π_θ: 0.4, 0.7, 0.7; δ = 0.5 drops only the one with A < 0 past δ."""
    logp = np.zeros((3, 3), np.float32)
    sampler = np.array([[0.6, 0.2, 50.0], [1.0, 0.4, 50.0], [0.9, 0.5, 50.0]], np.float32)
    mask = np.array([[1, 1, 0]] * 3, bool)
    fn = functools.partial(off_policy_mask, 0.5)
    fn = jax.jit(fn) if jit else fn
    keep, m = fn(jnp.asarray(logp), jnp.asarray(sampler), jnp.array([-1.0, -1.0, 1.0]), jnp.asarray(mask))
    assert np.asarray(keep).tolist() == [True, False, True]
    assert _frac(m, "opsm_masked_frac") == pytest.approx(1 / 3)
    assert _frac(m, "opsm_kl_mean") == pytest.approx(0.6, rel=1e-6)
    adv_BT = np.array([[-1, -1, -1], [-1, 2, -1], [-1, -1, -1]], np.float32)  # per token: each by its own A
    keep, m = fn(jnp.asarray(logp), jnp.asarray(sampler), jnp.asarray(adv_BT), jnp.asarray(mask))
    assert np.asarray(keep).tolist() == [[True] * 3, [False, True, True], [False, False, True]]
    assert _frac(m, "opsm_masked_frac") == pytest.approx(3 / 6)
    g = jax.grad(lambda x: jnp.sum(off_policy_mask(0.5, x, sampler, adv_BT, mask)[1]["opsm_kl_mean"].total))(logp)
    assert not np.any(np.asarray(g))  # no gradient through the mask or its statistic


def test_masks_are_the_identity_when_nothing_is_off_policy():
    rng = np.random.default_rng(3)
    logp = -rng.random((4, 6)).astype(np.float32)
    mask = rng.random((4, 6)) < 0.7
    cfg = LossConfig(icepop=True, geo_mask_delta=0.01, off_policy_mask_delta=0.0)
    c = corrections(cfg, jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(mask))
    assert np.asarray(c.keep).all() and c.weight is None
    keep, m = off_policy_mask(0.0, logp, logp, -np.ones(4, np.float32), mask)
    assert np.asarray(keep).all() and _frac(m, "opsm_masked_frac") == 0.0
    assert {k: float(v.compute()) for k, v in c.metrics.items()} == {"icepop_masked_frac": 0.0, "geo_masked_frac": 0.0}


def test_a_mask_zeroes_its_loss_inside_an_unchanged_denominator():
    """GRPO's seq_mean_token_mean over 2 completions: one token of the first and the whole second are
    masked; loss = (L_00 / 2 + 0) / 2 (n_0 and the sequence count unchanged); the KL term keeps its mask."""
    logp = np.log(np.array([[1.1, 0.9], [1.2, 1.0]], np.float32))
    old, mask, adv = np.zeros((2, 2), np.float32), np.ones((2, 2), bool), np.array([1.0, -1.0], np.float32)
    cfg = LossConfig()
    keep = np.array([[True, False], [False, False]])
    loss, m = policy_loss(cfg, logp, old, adv, mask, weights=LossWeights(keep=keep))
    assert float(loss) == pytest.approx(-1.1 / 2 / 2, rel=1e-6)
    g = jax.grad(lambda x: policy_loss(cfg, x, old, adv, mask, weights=LossWeights(keep=keep))[0])(jnp.asarray(logp))
    np.testing.assert_allclose(g, [[-1.1 / 4, 0.0], [0.0, 0.0]], rtol=1e-6)
    grpo = LossConfig(kl_coef=0.5)
    ref = np.full((2, 2), -0.3, np.float32)
    masked = policy_loss(grpo, logp, old, adv, mask, ref, weights=LossWeights(keep=np.zeros(2, bool)))[1]
    assert float(masked["policy_loss"].total) == 0.0
    assert float(masked["kl_loss"].total) == pytest.approx(
        float(policy_loss(grpo, logp, old, adv, mask, ref)[1]["kl_loss"].total)
    )
    gspo = LossConfig(ratio="sequence", aggregation="sequence")  # one loss per sequence: [B] masks only
    seq = policy_loss(gspo, logp, old, adv, mask, weights=LossWeights(keep=np.array([False, True])))[0]
    assert float(seq) == pytest.approx(float(policy_loss(gspo, logp[1:], old[1:], adv[1:], mask[1:])[0]) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="keep"):
        policy_loss(gspo, logp, old, adv, mask, weights=LossWeights(keep=keep))


def test_icepop_with_tis_is_the_papers_weight():
    """IcePop's M(k) = k on [a, b], 0 outside: `icepop` with token TIS capped at b ≥ every kept w."""
    sampler = np.zeros((1, 4), np.float32)
    old = np.log(np.array([[0.4, 0.8, 3.0, 6.0]], np.float32))
    mask = np.ones((1, 4), bool)
    logp = jnp.asarray(old + 0.05)
    cfg = LossConfig(aggregation="token_mean", icepop=True, is_correction="tis", is_cap=5.0)
    c = corrections(cfg, jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask))
    fn = lambda x: policy_loss(cfg, x, old, np.ones(1), c.mask_BT, weights=LossWeights(c.weight, c.keep))[0]
    g = jax.grad(fn)(logp)
    r = math.exp(0.05)  # every ratio, unclipped (A > 0, 1.05 < 1.2)
    np.testing.assert_allclose(g, [[0.0, -0.8 * r / 4, -3.0 * r / 4, 0.0]], rtol=1e-5)
    assert float(c.metrics["icepop_masked_frac"].compute()) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(icepop_low=0.0), "icepop_low"),
        (dict(icepop_low=2.0, icepop_high=2.0), "icepop_high"),
        (dict(geo_mask_delta=0.0), "geo_mask_delta"),
        (dict(geo_mask_delta=1.0), "geo_mask_delta"),
        (dict(off_policy_mask_delta=-0.1), "off_policy_mask_delta"),
        (dict(router_shift_floor=0.0), "router_shift_floor"),
        (dict(router_shift_floor=1.5), "router_shift_floor"),
        (dict(router_shift="yes"), "router_shift"),
        (dict(ratio="sequence", aggregation="sequence", icepop=True), "icepop"),
    ],
)
def test_bad_mask_and_router_shift_settings_are_refused_in_one_line(kwargs, field):
    with pytest.raises(ValueError, match=rf"^LossConfig\.{field}=.* is not allowed; ") as e:
        LossConfig(**kwargs)
    assert "\n" not in str(e.value)
