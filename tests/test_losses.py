"""Policy losses against ALGORITHMS.md: gradient identities, clipping, aggregation, masks, edge cases.

Gradients are taken w.r.t. logp: ∇θ L = Σ ∂L/∂logp · ∇θ logp, so ∂L/∂logp_{i,t} *is* the weight each
token's ∇logp gets, which is what the formulas specify.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo_jax import metrics, ratios
from gspo_jax.algorithms import ALGORITHMS
from gspo_jax.losses import LossConfig, LossWeights, loss_denominator, policy_loss

PRESETS = {name: a.loss for name, a in ALGORITHMS.items()}

ALL = sorted(PRESETS)
HYP = settings(max_examples=20, deadline=None)


def make_batch(seed, B=6, T=12, spread=0.3, per_token_adv=False, min_len=1):
    """Random prompt/completion layout: each row has a prompt prefix, a completion, then padding."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), np.float32)
    for i in range(B):
        start = rng.integers(0, T // 3)
        length = rng.integers(min_len, T - start + 1)
        mask[i, start : start + length] = 1
    logp = -rng.exponential(1.0, (B, T)).astype(np.float32)
    old = (logp + rng.normal(0, spread, (B, T))).astype(np.float32)
    ref = (logp + rng.normal(0, spread, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, (B, T) if per_token_adv else (B,)).astype(np.float32)
    return [jnp.asarray(x) for x in (logp, old, adv, mask, ref)]


def loss_fn(cfg, **kw):
    """(logp, old, adv, mask, ref) -> loss, for jax.grad w.r.t. logp."""
    return lambda logp, old, adv, mask, ref: policy_loss(cfg, logp, old, adv, mask, ref, **kw)[0]


def grad_logp(cfg, logp, old, adv, mask, ref=None, variant=None, **kw):
    """d loss / d logp; `variant` is chex's `self.variant` (the function as is, or under jax.jit)."""
    g = jax.grad(loss_fn(cfg, **kw))
    if variant is not None:
        g = variant(g)
    return g(logp, old, adv, mask, ref)


def run(variant, cfg, *args, **kw):
    """(loss, metric values)."""
    fn = variant(functools.partial(policy_loss, cfg))
    loss, m = fn(*args, **kw)
    return loss, metrics.compute(m)


# ------------------------------------------------------------------ gradient identities


class TestGradientIdentities(chex.TestCase):
    """Each test runs twice: eagerly and under `jax.jit` (chex variants), here and in the classes below."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_gradient_at_ratio_one_is_plain_policy_gradient(self):
        logp, _, adv, mask, _ = make_batch(0)
        cfg = PRESETS["grpo"]  # includes the k3 KL term, whose gradient vanishes at ref = logp
        g = grad_logp(cfg, logp, logp, adv, mask, logp, self.variant)
        m = np.asarray(mask)
        n_seq = (m.sum(1) > 0).sum()
        expected = -np.asarray(adv)[:, None] * m / np.maximum(m.sum(1, keepdims=True), 1) / n_seq
        np.testing.assert_allclose(g, expected, rtol=1e-6, atol=1e-8)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gspo_gradient_is_sequence_ratio_times_mean_token_gradient(self):
        logp, old, adv, mask, _ = make_batch(1, spread=1e-3)
        cfg = dataclasses.replace(PRESETS["gspo"], eps_low=1.0, eps_high=10.0)  # nothing clipped
        g = grad_logp(cfg, logp, old, adv, mask, None, self.variant)
        m = np.asarray(mask, np.float64)
        n = m.sum(1)
        s = np.exp(((np.asarray(logp, np.float64) - np.asarray(old)) * m).sum(1) / n)
        expected = -(s * np.asarray(adv))[:, None] * m / n[:, None] / len(n)
        np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-9)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gspo_clipped_sequence_contributes_nothing(self):
        logp, _, _, mask, _ = make_batch(2, B=4)
        m = np.asarray(mask)
        n = m.sum(1, keepdims=True)
        # sequence log-ratios +1e-3 with A > 0 (clipped high), -1e-3 with A < 0 (clipped low), and two free
        shift = np.array([1e-3, -1e-3, 1e-4, -1e-4], np.float32)[:, None]
        old = logp - jnp.asarray(shift * m)
        adv = jnp.asarray([1.0, -1.0, 1.0, -1.0])
        cfg = PRESETS["gspo"]
        g = np.asarray(grad_logp(cfg, logp, old, adv, mask, None, self.variant))
        assert np.all(g[:2] == 0.0)
        assert np.all(g[2:][m[2:] > 0] != 0.0)
        _, met = run(self.variant, cfg, logp, old, adv, mask)
        assert met["seq_clip_frac"] == pytest.approx(0.5)
        assert met["clip_frac_high"] == pytest.approx(m[0].sum() / m.sum())
        assert met["clip_frac_low"] == pytest.approx(m[1].sum() / m.sum())
        del n

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((f"seed{seed}", seed) for seed in (0, 1, 2))
    def test_gspo_token_equals_gspo_for_constant_advantages(self, seed):
        logp, old, adv, mask, _ = make_batch(seed, B=8, T=16, spread=2e-3)  # mix of clipped and free
        gspo, gspo_tok = PRESETS["gspo"], PRESETS["gspo_token"]
        adv_BT = jnp.broadcast_to(adv[:, None], mask.shape)
        l1, m1 = run(self.variant, gspo, logp, old, adv, mask)
        l2, m2 = run(self.variant, gspo_tok, logp, old, adv_BT, mask)
        np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-9)  # float32 rounding of a mean
        for k in ("clip_frac", "clip_frac_low", "clip_frac_high", "seq_clip_frac"):
            assert m1[k] == pytest.approx(float(m2[k]), abs=1e-7), k
        assert 0 < m1["seq_clip_frac"] < 1  # the seed really mixes clipped and unclipped sequences
        g1 = grad_logp(gspo, logp, old, adv, mask, None, self.variant)
        g2 = grad_logp(gspo_tok, logp, old, adv_BT, mask, None, self.variant)
        np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-9)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gspo_on_length_one_completions_equals_token_clipping(self):
        rng = np.random.default_rng(3)
        B, T = 16, 5
        mask = np.zeros((B, T), np.float32)
        mask[np.arange(B), rng.integers(0, T, B)] = 1
        logp = jnp.asarray(-rng.exponential(1.0, (B, T)), jnp.float32)
        old = logp + jnp.asarray(rng.normal(0, 0.3, (B, T)), jnp.float32)
        adv = jnp.asarray(rng.normal(0, 1, B), jnp.float32)
        mask = jnp.asarray(mask)
        gspo = dataclasses.replace(PRESETS["gspo"], eps_low=0.2, eps_high=0.28)
        tok = LossConfig(ratio="token", eps_low=0.2, eps_high=0.28, aggregation="seq_mean_token_mean")
        l1, m1 = run(self.variant, gspo, logp, old, adv, mask)
        l2, m2 = run(self.variant, tok, logp, old, adv, mask)
        np.testing.assert_allclose(l1, l2, rtol=1e-6)
        assert float(m1["clip_frac"]) == pytest.approx(float(m2["clip_frac"]))
        assert 0 < float(m1["clip_frac"]) < 1
        np.testing.assert_allclose(
            grad_logp(gspo, logp, old, adv, mask, None, self.variant),
            grad_logp(tok, logp, old, adv, mask, None, self.variant),
            rtol=1e-6,
        )


# ------------------------------------------------------------------ clipping


def _ratio_grid(ratios, advs):
    """One sequence, one token per (ratio, advantage) pair, per-token advantages."""
    r = np.array(ratios, np.float32)
    logp = jnp.zeros((1, len(r)), jnp.float32) - 1.0
    old = logp - jnp.log(jnp.asarray(r))[None]
    return logp, old, jnp.asarray(advs, jnp.float32)[None], jnp.ones((1, len(r)), jnp.float32)


class TestClipping(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("grpo", "grpo"), ("dapo", "dapo"))
    def test_clipped_tokens_get_exactly_zero_gradient(self, name):
        cfg = dataclasses.replace(PRESETS[name], kl_coef=0.0)
        lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
        ratios = [0.5, lo - 0.05, lo + 0.05, 1.0, hi - 0.05, hi + 0.05, 2.0]
        for sign in (1.0, -1.0):
            logp, old, adv, mask = _ratio_grid(ratios, [sign] * len(ratios))
            g = np.asarray(grad_logp(cfg, logp, old, adv, mask, None, self.variant))[0]
            r = np.array(ratios)
            clipped = (r > hi) if sign > 0 else (r < lo)
            assert np.all(g[clipped] == 0.0)
            assert np.all(g[~clipped] != 0.0)
            # unclipped tokens get -A·r / (T · N_seq) exactly
            np.testing.assert_allclose(g[~clipped], -sign * r[~clipped] / len(r), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_dapo_clip_higher_is_asymmetric(self):
        logp, old, adv, mask = _ratio_grid([1.25, 1.25, 0.82, 0.78], [1.0, 1.0, -1.0, -1.0])
        g_dapo = np.asarray(grad_logp(PRESETS["dapo"], logp, old, adv, mask, None, self.variant))[0]
        sym = LossConfig(eps_low=0.2, eps_high=0.2, aggregation="token_mean")
        g_sym = np.asarray(grad_logp(sym, logp, old, adv, mask, None, self.variant))[0]
        assert g_dapo[0] != 0 and g_sym[0] == 0  # 1.25 < 1.28 survives clip-higher, not 1.2
        assert g_dapo[2] != 0 and g_dapo[3] == 0  # low side stays at 0.8
        _, met = run(self.variant, PRESETS["dapo"], logp, old, adv, mask)
        assert float(met["clip_frac_low"]) == pytest.approx(0.25)
        assert float(met["clip_frac_high"]) == 0.0

    @chex.variants(with_jit=True, without_jit=True)
    def test_dual_clip_caps_negative_advantage_losses(self):
        cfg = LossConfig(eps_low=0.2, eps_high=0.2, dual_clip_c=3.0, aggregation="token_mean")
        plain = dataclasses.replace(cfg, dual_clip_c=None)
        logp, old, adv, mask = _ratio_grid([2.0, 5.0, 5.0], [-1.0, -1.0, 1.0])
        loss, met = run(self.variant, cfg, logp, old, adv, mask)
        loss_plain, _ = run(self.variant, plain, logp, old, adv, mask)
        # token losses: 2·1 (below c), min(5, 3)·1 = 3 (capped), -clip(5)·1 = -1.2 (A > 0, clipped high)
        assert float(loss) == pytest.approx((2.0 + 3.0 - 1.2) / 3, rel=1e-5)
        assert float(loss_plain) == pytest.approx((2.0 + 5.0 - 1.2) / 3, rel=1e-5)
        g = np.asarray(grad_logp(cfg, logp, old, adv, mask, None, self.variant))[0]
        assert g[0] != 0 and g[1] == 0 and g[2] == 0
        assert float(met["dual_clip_frac"]) == pytest.approx(1 / 3)

    @chex.variants(with_jit=True, without_jit=True)
    def test_cispo_never_drops_a_token_and_weights_by_clipped_ratio(self):
        cfg = PRESETS["cispo"]
        ratios = [0.1, 0.9, 1.0, 1.1, 1.5, 3.0]
        logp, old, adv, mask = _ratio_grid(ratios, [1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
        g = np.asarray(grad_logp(cfg, logp, old, adv, mask, None, self.variant))[0]
        w = np.clip(ratios, 1 - cfg.eps_low, 1 + cfg.eps_high)
        np.testing.assert_allclose(g, -w * np.asarray(adv)[0] / len(ratios), rtol=1e-6)
        _, met = run(self.variant, cfg, logp, old, adv, mask)
        assert float(met["clip_frac_high"]) == pytest.approx(2 / 6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_sapo_soft_gate_values_and_gradient(self):
        cfg = PRESETS["sapo"]
        ratios = np.array([1.0, 1.0, 1.5, 0.5], np.float32)
        a = np.array([2.0, -2.0, 1.0, -1.0], np.float32)
        logp, old, adv, mask = _ratio_grid(ratios, a)
        loss, met = run(self.variant, cfg, logp, old, adv, mask)
        tau = np.where(a > 0, 1.0, 1.05)
        sig = 1 / (1 + np.exp(-tau * (ratios - 1)))
        assert float(loss) == pytest.approx(np.mean(-a * 4 / tau * sig), rel=1e-5)
        g = np.asarray(grad_logp(cfg, logp, old, adv, mask, None, self.variant))[0]
        np.testing.assert_allclose(g, -a * 4 * sig * (1 - sig) * ratios / 4, rtol=1e-5)
        assert g[0] == pytest.approx(-2.0 / 4)  # equals the policy gradient at r = 1
        assert float(met["clip_frac"]) == 0.0

    @chex.variants(with_jit=True, without_jit=True)
    def test_gmpo_clips_tokens_in_log_space_on_the_advantage_side(self):
        cfg = PRESETS["gmpo"]  # eps 0.4 in log space
        delta = np.array([[0.6, 0.1, -0.6, 0.0], [0.6, 0.1, -0.6, 0.0]], np.float32)
        logp = jnp.full(delta.shape, -1.0)
        old = logp - jnp.asarray(delta)
        adv = jnp.asarray([1.0, -1.0])
        mask = jnp.ones(delta.shape)
        loss, met = run(self.variant, cfg, logp, old, adv, mask)
        x_pos = np.exp(np.mean([0.4, 0.1, -0.6, 0.0]))  # A > 0 clips only the high side
        x_neg = np.exp(np.mean([0.6, 0.1, -0.4, 0.0]))  # A < 0 clips only the low side
        assert float(loss) == pytest.approx((-x_pos + x_neg) / 2, rel=1e-5)
        g = np.asarray(grad_logp(cfg, logp, old, adv, mask, None, self.variant))
        np.testing.assert_allclose(g[0], [0.0, -x_pos / 8, -x_pos / 8, -x_pos / 8], rtol=1e-5)
        np.testing.assert_allclose(g[1], [x_neg / 8, x_neg / 8, 0.0, x_neg / 8], rtol=1e-5)
        assert float(met["clip_frac_high"]) == pytest.approx(1 / 8)
        assert float(met["clip_frac_low"]) == pytest.approx(1 / 8)


# ------------------------------------------------------------------ aggregation


def _long_short():
    T = 210
    mask = np.zeros((2, T), np.float32)
    mask[0, :200] = 1
    mask[1, :10] = 1
    logp = jnp.full((2, T), -1.0)
    return logp, jnp.asarray([1.0, 1.0]), jnp.asarray(mask)


def _split_sum(cfg, variant, batch, splits):
    logp, old, adv, mask, ref = batch
    denom = loss_denominator(cfg, mask)
    f = variant(loss_fn(cfg, denominator=denom))
    gf = variant(jax.grad(loss_fn(cfg, denominator=denom)))
    total, grads = 0.0, []
    for idx in np.array_split(np.arange(logp.shape[0]), splits):
        part = [x[idx] for x in (logp, old, adv, mask, ref)]
        total += f(*part)
        grads.append(gf(*part))
    return total, jnp.concatenate(grads)


class TestAggregation(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("seq_mean_token_mean", LossConfig(aggregation="seq_mean_token_mean"), 1 / 200 / 2, 1 / 10 / 2),
        ("token_mean", LossConfig(aggregation="token_mean"), 1 / 210, 1 / 210),
        ("sum_norm", LossConfig(aggregation="seq_mean_token_sum_norm", sum_norm_len=300.0), 1 / 300 / 2, 1 / 300 / 2),
        ("sequence", PRESETS["gspo"], 1 / 200 / 2, 1 / 10 / 2),
    )
    def test_aggregation_worked_example_200_and_10_tokens(self, cfg, w_long, w_short):
        logp, adv, mask = _long_short()
        g = np.asarray(grad_logp(cfg, logp, logp, adv, mask, None, self.variant))
        np.testing.assert_allclose(g[0, :200], -w_long, rtol=1e-6)
        np.testing.assert_allclose(g[1, :10], -w_short, rtol=1e-6)
        assert np.all(g[0, 200:] == 0) and np.all(g[1, 10:] == 0)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((name, name) for name in ALL)
    def test_minibatch_split_sums_to_full_batch(self, name):
        cfg = PRESETS[name]
        batch = make_batch(4, B=8, T=10, spread=0.1 if name not in ("gspo", "gspo_token", "gspo_sum") else 3e-4)
        full, _ = run(self.variant, cfg, *batch[:4], batch[4])
        full_g = grad_logp(cfg, *batch, variant=self.variant)
        total, g = _split_sum(cfg, self.variant, batch, splits=4)
        np.testing.assert_allclose(total, full, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(g, full_g, rtol=1e-5, atol=1e-8)


def test_local_denominator_differs_from_global_for_token_mean():
    """Guards the bug the global denominator exists for: per-minibatch token means are wrong."""
    cfg = PRESETS["dapo"]
    logp, old, adv, mask, ref = make_batch(5, B=4, T=12)
    full, _ = policy_loss(cfg, logp, old, adv, mask)
    naive = sum(
        policy_loss(cfg, logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2])[0] / 2 for i in (0, 2)
    )
    assert abs(float(naive) - float(full)) > 1e-4


# ------------------------------------------------------------------ masks and edge cases


class TestMasksAndEdgeCases(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((name, name) for name in ALL)
    def test_masked_positions_change_neither_loss_nor_gradient(self, name):
        cfg = PRESETS[name]
        logp, old, adv, mask, ref = make_batch(6, spread=0.1)
        off = mask == 0
        junk = jnp.asarray(np.random.default_rng(0).normal(0, 50, mask.shape), jnp.float32)
        logp2, old2, ref2 = (jnp.where(off, junk * k, x) for k, x in ((1, logp), (-2, old), (3, ref)))
        l1, _ = run(self.variant, cfg, logp, old, adv, mask, ref)
        l2, _ = run(self.variant, cfg, logp2, old2, adv, mask, ref2)
        assert float(l1) == float(l2)
        g1 = grad_logp(cfg, logp, old, adv, mask, ref, self.variant)
        g2 = grad_logp(cfg, logp2, old2, adv, mask, ref2, self.variant)
        np.testing.assert_array_equal(g1, g2)
        assert np.all(np.asarray(g2)[np.asarray(off)] == 0)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((name, name) for name in ALL)
    def test_empty_completions_give_finite_loss_and_zero_gradient(self, name):
        cfg = PRESETS[name]
        logp, old, adv, mask, ref = make_batch(7)
        empty = jnp.zeros_like(mask)
        loss, met = run(self.variant, cfg, logp, old, adv, empty, ref)
        assert float(loss) == 0.0
        assert all(np.isfinite(float(v)) for v in met.values())
        g = grad_logp(cfg, logp, old, adv, empty, ref, self.variant)
        assert np.all(np.asarray(g) == 0)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((name, name) for name in ALL)
    def test_an_empty_completion_is_left_out_of_the_batch(self, name):
        cfg = PRESETS[name]
        logp, old, adv, mask, ref = make_batch(8, B=5)
        mask_e = mask.at[2].set(0.0)
        keep = np.array([0, 1, 3, 4])
        l_with, _ = run(self.variant, cfg, logp, old, adv, mask_e, ref)
        l_without, _ = run(self.variant, cfg, *(x[keep] for x in (logp, old, adv, mask, ref)))
        np.testing.assert_allclose(l_with, l_without, rtol=1e-6)
        assert np.all(np.asarray(grad_logp(cfg, logp, old, adv, mask_e, ref, self.variant))[2] == 0)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        (f"{name}_{label}", name, sign) for name in ALL for label, sign in (("pos", 1.0), ("neg", -1.0))
    )
    def test_huge_log_ratios_give_finite_loss_and_gradient(self, name, sign):
        cfg = PRESETS[name]
        logp, _, adv, mask, ref = make_batch(9)
        old = logp - sign * 1e4
        loss, met = run(self.variant, cfg, logp, old, adv, mask, ref - sign * 1e4)
        assert np.isfinite(float(loss))
        assert all(np.isfinite(float(v)) for v in met.values())
        assert np.all(np.isfinite(grad_logp(cfg, logp, old, adv, mask, ref - sign * 1e4, self.variant)))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        (f"{name}_{jnp.dtype(dtype).name}", name, dtype)
        for name in ("grpo", "dapo", "gspo", "cispo")
        for dtype in (jnp.float16, jnp.bfloat16)
    )
    def test_low_precision_inputs_are_computed_in_float32(self, name, dtype):
        cfg = PRESETS[name]
        batch = make_batch(10)
        low = [x.astype(dtype) for x in batch]
        up = [x.astype(jnp.float32) for x in low]
        l_low, m_low = run(self.variant, cfg, *low[:4], low[4])
        l_up, _ = run(self.variant, cfg, *up[:4], up[4])
        assert l_low.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in m_low.values())
        assert float(l_low) == float(l_up)  # same values, cast first: identical float32 math

    @chex.variants(with_jit=True, without_jit=True)
    def test_zero_advantage_fraction_and_ratio_diagnostics(self):
        logp, old, adv, mask, ref = make_batch(11, B=4)
        adv = adv.at[1].set(0.0).at[3].set(0.0)
        _, met = run(self.variant, PRESETS["grpo"], logp, old, adv, mask, ref)
        assert float(met["zero_adv_frac"]) == 0.5
        m = np.asarray(mask) > 0
        r = np.exp(np.clip(np.asarray(logp) - np.asarray(old), -20, 20))[m]
        assert float(met["ratio_max"]) == pytest.approx(r.max(), rel=1e-6)
        assert float(met["ratio_min"]) == pytest.approx(r.min(), rel=1e-6)
        d = (np.asarray(logp) - np.asarray(old))[m]
        assert float(met["approx_kl"]) == pytest.approx(np.mean(np.exp(d) - d - 1), rel=1e-5)
        dr = (np.asarray(ref) - np.asarray(logp))[m]
        assert float(met["kl_ref"]) == pytest.approx(np.mean(np.exp(dr) - dr - 1), rel=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("k1", "k1"), ("k2", "k2"), ("k3", "k3"))
    def test_kl_term_is_coefficient_times_aggregated_estimator(self, estimator):
        cfg = LossConfig(kl_coef=0.1, kl_estimator=estimator, aggregation="token_mean")
        logp, _, adv, mask, ref = make_batch(12)
        loss, met = run(self.variant, cfg, logp, logp, jnp.zeros_like(adv), mask, ref)
        m = np.asarray(mask) > 0
        d = (np.asarray(ref, np.float64) - np.asarray(logp))[m]
        k = {"k1": -d, "k2": d**2 / 2, "k3": np.exp(d) - d - 1}[estimator]
        assert float(loss) == pytest.approx(0.1 * k.mean(), rel=1e-5, abs=1e-8)
        assert float(met["kl_loss"]) == pytest.approx(float(loss))


def test_kl_estimators_match_their_formulas():
    d = jnp.asarray([-2.0, -0.5, 0.0, 0.5, 2.0])
    dn = np.asarray(d, np.float64)
    np.testing.assert_allclose(ratios.kl_k1(d), -dn)
    np.testing.assert_allclose(ratios.kl_k2(d), dn**2 / 2)
    np.testing.assert_allclose(ratios.kl_k3(d), np.exp(dn) - dn - 1, rtol=1e-6)
    assert np.all(np.asarray(ratios.kl_k3(d)) >= 0)


def test_policy_loss_compiles_once_for_new_values(compile_counter):
    cfg = PRESETS["gspo"]
    f = jax.jit(functools.partial(policy_loss, cfg))
    batches = [make_batch(seed, B=6, T=12)[:4] for seed in range(4)]
    f(*batches[0])
    compile_counter.reset()
    for b in batches[1:]:
        f(*b)
    assert compile_counter.count == 0


# ------------------------------------------------------------------ VESPO and the unnormalised sequence ratio

# Shared inputs for the TRL check. Prompt/padding entries of logp and old are junk the mask drops; row 2 has
# a token log-ratio beyond ±20 (TRL clamps each token's before the sum); row 3 is empty.
TRL_MASK = np.array([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0]], np.float32)
TRL_LOGP = np.array(
    [
        [-3.0, -0.7, -1.2, -0.4, -9.0],
        [-0.3, -2.1, -0.9, -1.6, -0.5],
        [-0.2, -25.0, -7.0, -7.0, -7.0],
        [-1.0, -1.0, -1.0, -1.0, -1.0],
        [-1.4, -0.8, -2.2, -5.0, -5.0],
    ],
    np.float32,
)
TRL_DELTA = np.array(  # logp - old_logp
    [
        [3.0, 0.5, -0.1, 0.4, -4.0],
        [0.2, 0.1, 0.15, -0.05, 0.3],
        [21.0, -19.5, 2.0, 2.0, 2.0],
        [0.7, 0.7, 0.7, 0.7, 0.7],
        [-0.8, -0.6, -0.9, 1.0, 1.0],
    ],
    np.float32,
)
TRL_ADV = np.array([1.0, -0.5, 0.8, 1.3, -1.2], np.float32)
TRL_IS_RATIO = np.array(  # TIS weights π_old/π_sampler (cap 2); 1 off the mask, where TRL sums them too
    [
        [1.0, 0.9, 1.2, 2.0, 1.0],
        [1.1, 1.0, 0.8, 1.0, 1.3],
        [0.5, 1.5, 1.0, 1.0, 1.0],
        [1.0, 1.0, 1.0, 1.0, 1.0],
        [2.0, 2.0, 0.7, 1.0, 1.0],
    ],
    np.float32,
)
# Expected values from TRL's `vespo` loss, huggingface/trl@f2cd57710ae345ea6428ae95363267fcf38a3dc8,
# trl/trainer/grpo_trainer.py: `GRPOTrainer.get_gamma_weights` (its defaults k, λ = 2, 3 for A >= 0 and
# 3, 2 for A < 0) and the `vespo` branch of `GRPOTrainer._compute_loss`, aggregated as for loss_type "vespo"
# (Σ per_token_loss·mask / num_items_in_batch, one process). torch is not installed here, so the two were
# transcribed line by line into numpy (float64) and run on the inputs above. φ is computed under no_grad,
# so the gradient w.r.t. the log-probs is -φ_i·A_i·m_{i,t} / N_tokens. (loss, φ per sequence):
TRL_EXPECTED = {
    "plain": (
        0.3984460458171896,
        [0.12535284157887677, 1.0751869840003594, 0.3882274840370748, 1.0, 0.00609359117318359],
    ),
    "is_ratio": (
        0.9411899837392513,
        [2.5321065854039043e-4, 0.9013392953735924, 0.7520240275760433, 1.0, 0.09323880574407377],
    ),
}


def _pad_to_6x12(x, value):
    """Padding (an extra empty row, padding columns) around an array: it must change nothing."""
    return jnp.asarray(np.pad(x, [(0, 6 - len(x))] + [(0, 12 - x.shape[-1])] * (x.ndim - 1), constant_values=value))


def _one_sequence_per_row(log_ratios, lengths, B=6, T=12):
    """Row i: `lengths[i]` tokens whose log-ratios sum to log_ratios[i] (split evenly); rows past the
    given ones are empty."""
    n = np.zeros(B, np.float32)
    n[: len(lengths)] = lengths
    s = np.zeros(B, np.float32)
    s[: len(log_ratios)] = log_ratios
    mask = (np.arange(T)[None] < n[:, None]).astype(np.float32)
    logp = -np.linspace(0.5, 2.0, B * T, dtype=np.float32).reshape(B, T)
    delta = mask * (s / np.maximum(n, 1.0))[:, None]
    return jnp.asarray(logp), jnp.asarray(logp - delta), jnp.asarray(mask)


def run_with_grad(variant, cfg, logp, old, adv, mask, ref=None, **kw):
    """(loss, metric values, d loss / d logp) from one call: one compile under jit, not two."""
    f = variant(jax.value_and_grad(functools.partial(policy_loss, cfg), has_aux=True))
    (loss, m), g = f(logp, old, adv, mask, ref, **kw)
    return loss, metrics.compute(m), np.asarray(g)


class TestVespoAndSequenceSum(chex.TestCase):
    """The TRL check runs eagerly and jitted; the rest eagerly only, to keep compiles few: jit's equality
    with eager for both presets is `test_jitted_equals_eager`."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("plain", "plain"), ("is_ratio", "is_ratio"))
    def test_vespo_matches_trl_on_shared_inputs(self, case):
        cfg = PRESETS["vespo"]
        logp, old = _pad_to_6x12(TRL_LOGP, -3.0), _pad_to_6x12(TRL_LOGP - TRL_DELTA, 5.0)
        adv, mask = _pad_to_6x12(TRL_ADV, 0.7), _pad_to_6x12(TRL_MASK, 0.0)
        kw = dict(weights=LossWeights(is_weight=_pad_to_6x12(TRL_IS_RATIO, 1.0))) if case == "is_ratio" else {}
        want_loss, phi = TRL_EXPECTED[case]
        loss, _, g = run_with_grad(self.variant, cfg, logp, old, adv, mask, **kw)
        assert float(loss) == pytest.approx(want_loss, rel=1e-5)
        want_g = -(np.array(phi) * TRL_ADV)[:, None] * TRL_MASK / TRL_MASK.sum()
        np.testing.assert_allclose(g[:5, :5], want_g, rtol=1e-5, atol=1e-9)
        assert np.all(g[5:] == 0) and np.all(g[:, 5:] == 0)

    @chex.variants(without_jit=True)
    def test_vespo_gamma_kernel_values_and_gradient(self):
        cfg = PRESETS["vespo"]
        w = np.array([1.0, 0.5, 2.0, 1.5, 1.0])  # 1.5 = k/λ for A < 0: the kernel's peak
        a = np.array([2.0, 1.0, -1.0, -1.0, 0.0, 0.0], np.float32)  # row 5: empty
        lengths = [1, 2, 3, 2, 2]
        logp, old, mask = _one_sequence_per_row(np.log(w), lengths)
        loss, met, g = run_with_grad(self.variant, cfg, logp, old, jnp.asarray(a), mask)
        k, lam = np.where(a[:5] >= 0, 2.0, 3.0), np.where(a[:5] >= 0, 3.0, 2.0)
        phi = np.append(w**k * np.exp(lam * (1 - w)), 0.0)  # [1, e^1.5/4, 8/e^2, 3.375/e, 1]; 0 for the empty row
        n_tok, m = sum(lengths), np.asarray(mask)
        assert float(loss) == pytest.approx(np.sum(-phi * a * (np.asarray(logp) * m).sum(1)) / n_tok, rel=1e-5)
        np.testing.assert_allclose(g, -(phi * a)[:, None] * m / n_tok, rtol=1e-5, atol=1e-9)
        assert g[0, 0] == pytest.approx(-2.0 / n_tok)  # φ(1) = 1: the plain policy gradient
        assert float(met["clip_frac"]) == 0.0  # a soft kernel: nothing is hard-clipped
        assert float(met["grad_weight_mean"]) == pytest.approx(np.sum(phi[:5] * lengths) / n_tok, rel=1e-5)
        assert float(met["seq_ratio_max"]) == pytest.approx(2.0, rel=1e-5)  # W, not GSPO's s

    @chex.variants(without_jit=True)
    def test_vespo_on_policy_gradient_equals_dapos(self):
        logp, _, adv, mask, _ = make_batch(20)  # DAPO aggregates with token_mean too; at ratio 1 all weights are 1
        g = grad_logp(PRESETS["vespo"], logp, logp, adv, mask, None, self.variant)
        np.testing.assert_allclose(g, grad_logp(PRESETS["dapo"], logp, logp, adv, mask, None, self.variant), rtol=1e-6)

    @chex.variants(without_jit=True)
    def test_vespo_folds_the_correction_into_w(self):
        cfg = PRESETS["vespo"]
        logp, old, adv, mask, _ = make_batch(21, spread=0.05)
        w_BT = jnp.asarray(np.random.default_rng(0).uniform(0.6, 1.6, mask.shape), jnp.float32)
        w_B = jnp.exp(jnp.sum(jnp.where(mask > 0, jnp.log(w_BT), 0.0), axis=-1))  # the same weight, per sequence
        plain, _ = run(self.variant, cfg, logp, old, adv, mask)
        ones, _ = run(self.variant, cfg, logp, old, adv, mask, weights=LossWeights(is_weight=jnp.ones_like(mask)))
        tok, _ = run(self.variant, cfg, logp, old, adv, mask, weights=LossWeights(is_weight=w_BT))
        seq, _ = run(self.variant, cfg, logp, old, adv, mask, weights=LossWeights(is_weight=w_B))
        assert float(ones) == pytest.approx(float(plain), rel=1e-6)
        assert float(tok) == pytest.approx(float(seq), rel=1e-5) and abs(float(tok) - float(plain)) > 1e-3

    @chex.variants(without_jit=True)
    def test_sequence_sum_is_the_clipped_product_and_sequence_sum_token_has_its_gradient(self):
        """gspo_sum: W = Π_t r_t clipped per sequence with GSPO's band, loss -W·A (or the bound), gradient
        -W·A on every token (no 1/|o|) or 0 if clipped. sequence_sum_token's per-token gradients are the same
        up to the denominator (tokens, not sequences); clipping decisions are the sequence's, broadcast."""
        gsum = PRESETS["gspo_sum"]
        tok = LossConfig(ratio="sequence_sum_token", eps_low=3e-4, eps_high=4e-4, aggregation="token_mean")
        logp, old, adv, mask, _ = make_batch(24, spread=2e-4)
        m, a = np.asarray(mask, np.float64), np.asarray(adv, np.float64)
        w = np.exp(((np.asarray(logp, np.float64) - np.asarray(old)) * m).sum(1))
        high, low = (a > 0) & (w > 1 + 4e-4), (a < 0) & (w < 1 - 3e-4)
        n_seq = (m.sum(1) > 0).sum()
        loss, m1, g1 = run_with_grad(self.variant, gsum, logp, old, adv, mask)
        want = np.where(high, -(1 + 4e-4) * a, np.where(low, -(1 - 3e-4) * a, -w * a))
        assert float(loss) == pytest.approx(want.sum() / n_seq, rel=1e-5)
        assert (
            float(m1["seq_clip_frac"]) == pytest.approx((high | low).sum() / n_seq) and 0 < (high | low).sum() < n_seq
        )
        np.testing.assert_allclose(g1, np.where(high | low, 0.0, -w * a)[:, None] * m / n_seq, rtol=1e-5, atol=1e-9)
        adv_BT = jnp.broadcast_to(adv[:, None], mask.shape)  # token-level advantages are accepted
        _, m2, g2 = run_with_grad(self.variant, tok, logp, old, adv_BT, mask)
        np.testing.assert_allclose(g1 * n_seq, g2 * m.sum(), rtol=1e-5, atol=1e-7)
        for k in ("clip_frac", "clip_frac_low", "clip_frac_high", "seq_clip_frac", "seq_ratio_mean"):
            assert float(m1[k]) == pytest.approx(float(m2[k]), rel=1e-6), k

    @chex.variants(without_jit=True)
    def test_sequence_sum_differs_from_gspo_by_the_length_only(self):
        # one token per completion: W = s, so loss, diagnostics and gradient are GSPO's exactly
        rng = np.random.default_rng(23)
        mask = np.zeros((6, 12), np.float32)
        mask[np.arange(6), rng.integers(0, 12, 6)] = 1
        logp = jnp.asarray(-rng.exponential(1.0, (6, 12)), jnp.float32)
        old = logp + jnp.asarray(rng.normal(0, 0.3, (6, 12)), jnp.float32)
        adv, mask = jnp.asarray(rng.normal(0, 1, 6), jnp.float32), jnp.asarray(mask)
        gspo, gsum = PRESETS["gspo"], PRESETS["gspo_sum"]
        l1, m1, g1 = run_with_grad(self.variant, gspo, logp, old, adv, mask)
        l2, m2, g2 = run_with_grad(self.variant, gsum, logp, old, adv, mask)
        assert float(l1) == float(l2) and m1 == m2 and 0 < m1["seq_clip_frac"] < 1
        np.testing.assert_array_equal(g1, g2)
        # ten tokens at Δ = 1e-4 leave s = e^1e-4 inside GSPO's band [1 - 3e-4, 1 + 4e-4], not W = e^1e-3
        logp, old, mask = _one_sequence_per_row([1e-3], [10])
        adv = jnp.ones(6)
        assert np.all(np.asarray(grad_logp(gspo, logp, old, adv, mask, None, self.variant))[0, :10] != 0)
        assert np.all(np.asarray(grad_logp(gsum, logp, old, adv, mask, None, self.variant)) == 0)


@pytest.mark.parametrize("name", ["vespo", "gspo_sum"])
def test_jitted_equals_eager(name):
    batch = make_batch(25, spread=2e-4 if name == "gspo_sum" else 0.1)
    eager = run_with_grad(lambda f: f, PRESETS[name], *batch[:4])
    jitted = run_with_grad(jax.jit, PRESETS[name], *batch[:4])
    assert float(jitted[0]) == pytest.approx(float(eager[0]), rel=1e-6)
    assert {k: float(v) for k, v in jitted[1].items()} == pytest.approx({k: float(v) for k, v in eager[1].items()})
    np.testing.assert_allclose(jitted[2], eager[2], rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ config validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(ratio="tokens"), "ratio"),
        (dict(gate="ppo"), "gate"),
        (dict(aggregation="mean"), "aggregation"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_high=float("nan")), "eps_high"),
        (dict(dual_clip_c=1.0), "dual_clip_c"),
        (dict(dual_clip_c=0.5), "dual_clip_c"),
        (dict(gate="cispo", dual_clip_c=3.0), "dual_clip_c"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(sapo_tau_pos=0.0, gate="sapo"), "sapo_tau_pos"),
        (dict(log_ratio_clamp=0.0), "log_ratio_clamp"),
        (dict(ratio="sequence", gate="cispo", aggregation="sequence"), "gate"),
        (dict(ratio="sequence_token", gate="cispo"), "gate"),
        (dict(ratio="geometric", gate="sapo", aggregation="sequence"), "gate"),
        (dict(ratio="sequence", aggregation="token_mean"), "aggregation"),
        (dict(ratio="token", aggregation="sequence"), "aggregation"),
        (dict(aggregation="seq_mean_token_sum_norm"), "sum_norm_len"),
        (dict(aggregation="seq_mean_token_sum_norm", sum_norm_len=0.0), "sum_norm_len"),
        (dict(gate="vespo"), "gate"),  # VESPO's kernel weighs the unnormalised sequence ratio only
        (dict(ratio="sequence_sum", gate="vespo", aggregation="sequence"), "gate"),
        (dict(ratio="sequence_sum_token", gate="cispo"), "gate"),
        (dict(ratio="sequence_sum", aggregation="token_mean"), "aggregation"),
        (dict(ratio="sequence_sum_token", aggregation="sequence"), "aggregation"),
        (dict(ratio="sequence_sum", aggregation="sequence", is_correction="tis"), "is_level"),
        (dict(vespo_lambda_pos=0.0), "vespo_lambda_pos"),
        (dict(vespo_k_neg=-1.0), "vespo_k_neg"),
        (dict(vespo_lambda_neg=float("inf")), "vespo_lambda_neg"),
    ],
)
def test_invalid_configs_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LossConfig(**kwargs)


def test_invalid_values_on_replace_are_caught_too():
    with pytest.raises(ValueError, match="eps_high"):
        dataclasses.replace(PRESETS["dapo"], eps_high=-1)


def test_bad_arguments_raise_before_any_math():
    logp, old, adv, mask, ref = make_batch(14)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(PRESETS["grpo"], logp, old, adv, mask)
    with pytest.raises(ValueError, match="sequence_token"):
        policy_loss(PRESETS["gspo"], logp, old, jnp.broadcast_to(adv[:, None], mask.shape), mask)
    with pytest.raises(ValueError, match="sequence_sum_token"):
        policy_loss(PRESETS["gspo_sum"], logp, old, jnp.broadcast_to(adv[:, None], mask.shape), mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(PRESETS["dapo"], logp, old, adv[:3], mask)
    with pytest.raises(AssertionError, match="old_logp"):  # chex shape check at the boundary
        policy_loss(PRESETS["dapo"], logp, old[:, :3], adv, mask)


def test_presets_carry_the_paper_values():
    assert (PRESETS["grpo"].eps_low, PRESETS["grpo"].eps_high, PRESETS["grpo"].kl_coef) == (0.2, 0.2, 0.04)
    assert PRESETS["grpo"].kl_estimator == "k3" and PRESETS["grpo"].aggregation == "seq_mean_token_mean"
    assert (PRESETS["dapo"].eps_low, PRESETS["dapo"].eps_high, PRESETS["dapo"].kl_coef) == (0.2, 0.28, 0.0)
    assert PRESETS["dapo"].aggregation == "token_mean"
    assert (PRESETS["gspo"].ratio, PRESETS["gspo"].eps_low, PRESETS["gspo"].eps_high) == ("sequence", 3e-4, 4e-4)
    assert PRESETS["gspo_token"].ratio == "sequence_token"
    assert PRESETS["dr_grpo"].aggregation == "seq_mean_token_sum_norm"
    assert PRESETS["gmpo"].ratio == "geometric"
    assert PRESETS["cispo"].gate == "cispo"
    assert (PRESETS["sapo"].sapo_tau_pos, PRESETS["sapo"].sapo_tau_neg) == (1.0, 1.05)
    v = PRESETS["vespo"]
    assert (v.ratio, v.gate, v.aggregation, v.kl_coef) == ("sequence_sum_token", "vespo", "token_mean", 0.0)
    assert (v.vespo_k_pos, v.vespo_lambda_pos, v.vespo_k_neg, v.vespo_lambda_neg) == (2.0, 3.0, 3.0, 2.0)
    s = PRESETS["gspo_sum"]  # GSPO but for the 1/|o|
    assert dataclasses.replace(s, ratio="sequence") == PRESETS["gspo"] and s.ratio == "sequence_sum"


# ------------------------------------------------------------------ property-based


@st.composite
def batches(draw, per_token_adv=False):
    B = draw(st.sampled_from([1, 4]))  # few distinct shapes: every new shape is a new compile
    T = draw(st.sampled_from([3, 8]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    mask = (rng.random((B, T)) < draw(st.floats(0.0, 1.0))).astype(np.float32)
    scale = draw(st.sampled_from([1e-4, 0.05, 1.0, 30.0]))
    logp = -rng.exponential(1.0, (B, T)).astype(np.float32)
    old = (logp + rng.normal(0, scale, (B, T))).astype(np.float32)
    ref = (logp + rng.normal(0, scale, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, (B, T) if per_token_adv else (B,)).astype(np.float32)
    adv[rng.random(adv.shape) < 0.2] = 0.0
    return [jnp.asarray(x) for x in (logp, old, adv, mask, ref)]


class TestProperties(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @HYP
    @given(batch=batches(), name=st.sampled_from(ALL), splits=st.integers(1, 3))
    def test_property_finite_and_minibatch_additive(self, batch, name, splits):
        cfg = PRESETS[name]
        loss, met = run(self.variant, cfg, *batch[:4], batch[4])
        assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in met.values())
        g = grad_logp(cfg, *batch, variant=self.variant)
        assert np.all(np.isfinite(g))
        assert np.all(np.asarray(g)[np.asarray(batch[3]) == 0] == 0)
        splits = min(splits, batch[0].shape[0])
        total, g_split = _split_sum(cfg, self.variant, batch, splits)
        np.testing.assert_allclose(total, loss, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g_split, g, rtol=1e-4, atol=1e-6)
        for k in ("clip_frac", "clip_frac_low", "clip_frac_high", "seq_clip_frac", "zero_adv_frac"):
            assert 0.0 <= float(met[k]) <= 1.0

    @chex.variants(with_jit=True, without_jit=True)
    @HYP
    @given(
        batch=batches(per_token_adv=True),
        name=st.sampled_from(["grpo", "dapo", "gspo_token", "cispo", "sapo", "dr_grpo", "vespo"]),
    )
    def test_property_masked_values_are_ignored(self, batch, name):
        cfg = PRESETS[name]
        logp, old, adv, mask, ref = batch
        off = mask == 0
        logp2, old2, ref2, adv2 = (jnp.where(off, v, x) for v, x in ((7.0, logp), (-1e3, old), (1e3, ref), (1e6, adv)))
        l1, _ = run(self.variant, cfg, logp, old, adv, mask, ref)
        l2, _ = run(self.variant, cfg, logp2, old2, adv2, mask, ref2)
        assert float(l1) == float(l2)
        np.testing.assert_array_equal(
            grad_logp(cfg, logp, old, adv, mask, ref, self.variant),
            grad_logp(cfg, logp2, old2, adv2, mask, ref2, self.variant),
        )

    @chex.variants(with_jit=True, without_jit=True)
    @HYP
    @given(batch=batches())
    def test_property_gspo_token_equals_gspo(self, batch):
        logp, old, adv, mask, _ = batch
        adv_BT = jnp.broadcast_to(adv[:, None], mask.shape)
        l1, m1 = run(self.variant, PRESETS["gspo"], logp, old, adv, mask)
        l2, m2 = run(self.variant, PRESETS["gspo_token"], logp, old, adv_BT, mask)
        np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-6)
        assert float(m1["clip_frac"]) == pytest.approx(float(m2["clip_frac"]), abs=1e-6)
        np.testing.assert_allclose(
            grad_logp(PRESETS["gspo"], logp, old, adv, mask, None, self.variant),
            grad_logp(PRESETS["gspo_token"], logp, old, adv_BT, mask, None, self.variant),
            rtol=1e-4,
            atol=1e-7,
        )

    @chex.variants(with_jit=True, without_jit=True)
    @HYP
    @given(batch=batches(), name=st.sampled_from(["grpo", "dapo"]))
    def test_property_clipped_tokens_have_zero_gradient(self, batch, name):
        cfg = dataclasses.replace(PRESETS[name], kl_coef=0.0)
        logp, old, adv, mask, _ = batch
        g = np.asarray(grad_logp(cfg, logp, old, adv, mask, None, self.variant))
        r = np.exp(np.clip(np.asarray(logp) - np.asarray(old), -20, 20))
        a = np.asarray(adv)[:, None]
        m = np.asarray(mask) > 0
        clipped = m & (((a > 0) & (r > 1 + cfg.eps_high)) | ((a < 0) & (r < 1 - cfg.eps_low)))
        free = m & ~clipped & (a != 0) & (np.abs(np.asarray(logp) - np.asarray(old)) < 20)
        assert np.all(g[clipped] == 0)
        assert np.all(g[free] != 0)
