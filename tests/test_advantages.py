"""Group advantages, the dynamic-sampling filter and overlong shaping, against hand-computed values."""

import functools

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo_jax.advantages import (
    explained_variance,
    gae,
    group_advantages,
    informative_groups,
    overlong_penalty,
    token_rewards,
    whiten,
)
from gspo_jax.algorithms import ALGORITHMS

HYP = settings(max_examples=30, deadline=None)


def adv(variant, rewards, group_size, **kw):
    """`group_advantages` through `variant` (chex's `self.variant`: as is, or under jax.jit)."""
    return np.asarray(
        variant(functools.partial(group_advantages, group_size=group_size, **kw))(jnp.asarray(rewards, jnp.float32))
    )


class TestGroupAdvantages(chex.TestCase):
    """Each test runs twice: with the function as is and under `jax.jit` (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_computed_group_advantages(self):
        a = adv(self.variant, [1, 0, 0, 1, 1, 1, 1, 0], 4)
        s = np.sqrt(4 * 0.25 / 3)  # sample std of [1, 0, 0, 1]
        np.testing.assert_allclose(a[:4], [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rtol=1e-5)
        s2 = np.std([1, 1, 1, 0], ddof=1)
        np.testing.assert_allclose(a[4:], np.array([0.25, 0.25, 0.25, -0.75]) / s2, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        (f"{scale}_{value:g}", scale, value)
        for scale in ("group", "batch", "none")
        for value in (0.0, 1.0, 0.1, 1e8, -3.3)
    )
    def test_all_equal_groups_get_exactly_zero_never_nan(self, scale, value):
        r = [value] * 5 + [0.0, 1.0, 0.0, 1.0, 1.0]
        a = adv(self.variant, r, 5, scale=scale, eps=0.0)
        assert np.all(a[:5] == 0.0)
        assert np.all(np.isfinite(a))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((scale, scale) for scale in ("group", "batch", "none"))
    def test_group_of_size_one_is_zero(self, scale):
        a = adv(self.variant, [0.3, 1.0, -2.0], 1, scale=scale, eps=0.0)
        assert np.all(a == 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_no_scaling_is_dr_grpo_centering(self):
        a = adv(self.variant, [2.0, 0.0, 1.0, 1.0], 2, scale="none")
        np.testing.assert_allclose(a, [1.0, -1.0, 0.0, 0.0])
        assert ALGORITHMS["dr_grpo"].advantage_scale == "none"
        group_relative = {name: a for name, a in ALGORITHMS.items() if not a.critic}  # PPO uses GAE instead
        assert {a.advantage_scale for name, a in group_relative.items() if name != "dr_grpo"} == {"group"}

    @chex.variants(with_jit=True, without_jit=True)
    def test_batch_scaling_uses_the_std_of_all_rewards(self):
        r = np.array([2.0, 0.0, 1.0, 0.0])
        a = adv(self.variant, r, 2, scale="batch", eps=0.0)
        np.testing.assert_allclose(a, np.array([1.0, -1.0, 0.5, -0.5]) / np.std(r, ddof=1), rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_invalid_groups_get_zero_and_are_left_out_of_batch_std(self):
        r = np.array([2.0, 0.0, 50.0, -50.0])
        valid = np.array([1, 1, 0, 0], bool)
        fn = self.variant(functools.partial(group_advantages, group_size=2, scale="batch", eps=0.0))
        a = np.asarray(fn(jnp.asarray(r), valid=jnp.asarray(valid)))
        np.testing.assert_allclose(
            a, [1 / np.std([2.0, 0.0], ddof=1), -1 / np.std([2.0, 0.0], ddof=1), 0, 0], rtol=1e-6
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_informative_groups_flags_groups_with_spread(self):
        f = self.variant(functools.partial(informative_groups, group_size=3))
        got = np.asarray(f(jnp.asarray([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])))
        np.testing.assert_array_equal(got, [False, True, False])

    @chex.variants(with_jit=True, without_jit=True)
    def test_overlong_penalty_at_and_around_both_thresholds(self):
        f = self.variant(functools.partial(overlong_penalty, max_len=20, cache_len=4))
        lengths = jnp.asarray([0, 15, 16, 17, 18, 19, 20, 21, 100])
        np.testing.assert_allclose(f(lengths), [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0], rtol=1e-6)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="scale"):
        group_advantages(jnp.zeros(4), 2, scale="std")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(jnp.zeros(4), 0)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(jnp.zeros(5), 2)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(jnp.zeros(3), 10, 11)


@st.composite
def grouped_rewards(draw):
    g = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.sampled_from([1, 3]))
    vals = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 0.1, 1e6]), min_size=g * n, max_size=g * n))
    return np.array(vals, np.float32), g


class TestGroupAdvantagesProperties(chex.TestCase):
    """Hypothesis properties, each run eagerly and under `jax.jit` (chex variants outermost)."""

    @chex.variants(with_jit=True, without_jit=True)
    @HYP
    @given(data=grouped_rewards(), scale=st.sampled_from(["group", "batch", "none"]))
    def test_property_finite_zero_mean_and_zero_for_constant_groups(self, data, scale):
        r, g = data
        a = adv(self.variant, r, g, scale=scale).reshape(-1, g)
        rg = r.reshape(-1, g)
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a.mean(1), 0.0, atol=1e-3 * max(1.0, np.abs(a).max()))
        constant = rg.max(1) == rg.min(1)
        assert np.all(a[constant] == 0.0)
        # ordering inside a group follows the rewards
        for row_a, row_r in zip(a, rg):
            assert np.all(np.sign(np.subtract.outer(row_a, row_a)) == np.sign(np.subtract.outer(row_r, row_r)))

    @chex.variants(with_jit=True, without_jit=True)
    @HYP
    @given(data=grouped_rewards(), c=st.floats(0.1, 10.0), b=st.floats(-5.0, 5.0))
    def test_property_group_scaling_is_affine_invariant(self, data, c, b):
        r, g = data
        r = np.where(np.abs(r) > 10, 1.0, r)  # keep c·r + b well conditioned
        a1 = adv(self.variant, r, g, eps=0.0)
        a2 = adv(self.variant, c * r + b, g, eps=0.0)
        np.testing.assert_allclose(a1, a2, rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------------------------
# PPO: token rewards, GAE, whitening and explained variance. Unmasked positions often hold NaN / huge
# garbage on purpose: they must never reach a masked token's result.


def run_gae(variant, r, v, m, gamma, lam):
    a, ret = variant(gae)(jnp.asarray(r, jnp.float32), jnp.asarray(v, jnp.float32), jnp.asarray(m), gamma, lam)
    return np.asarray(a), np.asarray(ret)


def scatter_rows(rng, x_BT, m_BT, T2, max_prefix=3):
    """Each row's T entries placed at random increasing positions of a T2-long row after an unmasked
    prompt-like prefix; every other position is unmasked garbage (huge, NaN or inf). Returns x, m, positions."""
    B, T = x_BT.shape
    out = rng.normal(size=(B, T2)).astype(np.float32) * 1e4
    out[rng.random((B, T2)) < 0.2] = np.nan
    out[rng.random((B, T2)) < 0.1] = np.inf
    m2 = np.zeros((B, T2), m_BT.dtype)
    pos = np.zeros((B, T), int)
    for b in range(B):
        p = rng.integers(0, max_prefix + 1)
        pos[b] = p + np.sort(rng.choice(T2 - p, size=T, replace=False))
        out[b, pos[b]], m2[b, pos[b]] = x_BT[b], m_BT[b]
    return out, m2, pos


class TestGAE(chex.TestCase):
    """Each test runs twice: as is and under `jax.jit` (then gamma, lam and kl_coef are traced)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_lambda_one_gamma_one_is_reward_to_go_minus_value(self):
        m = np.array([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 1, 0, 1]], np.float32)
        v = np.array([[9, 0.5, -1.0, 2.0, 9], [0.1, 0.2, 0.3, 0.4, 0.5], [1.0, 9, -2.0, 9, 3.0]], np.float32)
        R = np.array([1.0, -0.5, 2.0], np.float32)
        r = np.asarray(token_rewards(jnp.asarray(R), jnp.asarray(m)))
        a, ret = run_gae(self.variant, r, v, m, 1.0, 1.0)
        np.testing.assert_allclose(a, np.where(m > 0, R[:, None] - v, 0.0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ret, np.where(m > 0, R[:, None], 0.0), rtol=1e-6, atol=1e-6)
        # dense rewards: A_t = Σ_{s >= t} r_s − V_t (reward-to-go over a full row)
        dense = np.array([[0.3, -0.2, 0.7, 0.0, 1.5]] * 3, np.float32)
        full = np.ones_like(m)
        a, ret = run_gae(self.variant, dense, v, full, 1.0, 1.0)
        to_go = np.cumsum(dense[:, ::-1], axis=1)[:, ::-1]
        np.testing.assert_allclose(a, to_go - v, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret, to_go, rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_lambda_zero_is_one_step_td_error(self):
        rng = np.random.default_rng(0)
        r = rng.normal(size=(2, 6)).astype(np.float32)
        v = rng.normal(size=(2, 6)).astype(np.float32)
        a, ret = run_gae(self.variant, r, v, np.ones((2, 6), bool), 0.9, 0.0)
        v_next = np.concatenate([v[:, 1:], np.zeros((2, 1), np.float32)], axis=1)  # terminal after the last
        np.testing.assert_allclose(a, r + 0.9 * v_next - v, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret, r + 0.9 * v_next, rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_computed_three_tokens(self):
        r = [[0.1, 0.0, 1.0]]
        v = [[0.5, 0.2, -0.1]]
        a, ret = run_gae(self.variant, r, v, [[1.0, 1.0, 1.0]], 0.9, 0.8)
        a2 = 1.0 + 0.9 * 0.0 - (-0.1)  # last token: terminal next state
        a1 = (0.0 + 0.9 * (-0.1) - 0.2) + 0.9 * 0.8 * a2
        a0 = (0.1 + 0.9 * 0.2 - 0.5) + 0.9 * 0.8 * a1
        np.testing.assert_allclose(a[0], [a0, a1, a2], rtol=1e-6)
        np.testing.assert_allclose(ret[0], [a0 + 0.5, a1 + 0.2, a2 - 0.1], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((0, 0.9, 0.8), (1, 1.0, 1.0), (2, 0.5, 0.0), (3, 0.0, 0.95))
    def test_padding_columns_anywhere_change_nothing(self, seed, gamma, lam):
        rng = np.random.default_rng(seed)
        B, T = 4, 5
        lengths = np.array([5, 3, 1, 0])
        m = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)  # incl. an empty row
        v = rng.normal(size=(B, T)).astype(np.float32)
        kl = rng.normal(size=(B, T)).astype(np.float32)
        R = rng.normal(size=B).astype(np.float32)
        v2, m2, pos = scatter_rows(rng, v, m, T + 7)
        kl2, _, _ = scatter_rows(rng, kl, m, T + 7)
        kl2[np.arange(B)[:, None], pos] = kl  # same positions as v2 (scatter_rows drew new ones)
        kl2[m2 == 0] = np.nan
        m2_bool = m2 > 0  # a bool mask on one side, float32 on the other

        tr = self.variant(token_rewards)
        r = np.asarray(tr(jnp.asarray(R), jnp.asarray(m), jnp.asarray(kl), 0.05))
        r2 = np.asarray(tr(jnp.asarray(R), jnp.asarray(m2_bool), jnp.asarray(kl2), 0.05))
        a, ret = run_gae(self.variant, r, v, m, gamma, lam)
        r2_garbage = np.where(m2_bool, r2, np.nan)  # gae must ignore whatever sits at unmasked positions
        a2, ret2 = run_gae(self.variant, r2_garbage, v2, m2_bool, gamma, lam)

        rows = np.arange(B)[:, None]
        for x, x2 in ((r, r2), (a, a2), (ret, ret2)):
            assert np.all(np.isfinite(x2))
            np.testing.assert_allclose(x2[rows, pos] * m, x * m, rtol=1e-6, atol=1e-6)
            assert np.all(x2[~m2_bool] == 0.0) and np.all(x[m == 0] == 0.0)
        assert np.any(a2[m2_bool] != 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_token_rewards_last_masked_token_kl_everywhere_empty_rows_nothing(self):
        m = np.array([[0, 1, 1, 0, 0], [1, 0, 1, 0, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]], np.float32)
        R = jnp.asarray([2.0, 3.0, 5.0, 7.0])
        kl = np.arange(20, dtype=np.float32).reshape(4, 5)
        tr = self.variant(token_rewards)
        want = np.zeros((4, 5), np.float32)
        want[0, 2], want[1, 4], want[3, 4] = 2.0, 3.0, 7.0
        np.testing.assert_array_equal(tr(R, jnp.asarray(m)), want)
        np.testing.assert_array_equal(tr(R, jnp.asarray(m), jnp.asarray(kl), 0.0), want)
        got = np.asarray(tr(R, jnp.asarray(m > 0), jnp.asarray(kl), 0.1))
        np.testing.assert_allclose(got, want - 0.1 * kl * m, rtol=1e-6)
        assert got[0, 1] == np.float32(-0.1 * 1) and np.all(got[2] == 0.0) and got.dtype == np.float32

    @chex.variants(with_jit=True, without_jit=True)
    def test_whiten_masked_mean_zero_unbiased_std_one(self):
        rng = np.random.default_rng(1)
        x = rng.normal(3.0, 5.0, size=(3, 8)).astype(np.float32)
        m = rng.random((3, 8)) < 0.6
        x[~m] = np.nan
        w = np.asarray(self.variant(whiten)(jnp.asarray(x), jnp.asarray(m), 0.0))
        assert np.all(w[~m] == 0.0)
        np.testing.assert_allclose(w[m].mean(), 0.0, atol=1e-6)
        np.testing.assert_allclose(w[m].std(ddof=1), 1.0, rtol=1e-5)
        # hand-computed: [1, 2, 3, 4] has mean 2.5 and sample variance 5/3
        w = np.asarray(
            self.variant(whiten)(jnp.asarray([[1.0, 9.0, 2.0], [3.0, 4.0, -9.0]]), jnp.asarray([[1, 0, 1], [1, 1, 0]]))
        )
        np.testing.assert_allclose(w, np.array([[-1.5, 0, -0.5], [0.5, 1.5, 0]]) / np.sqrt(5 / 3), rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*[(value, eps) for value in (0.0, 0.1, 1e8, -3.3) for eps in (0.0, 1e-8)])
    def test_whiten_all_equal_single_or_no_token_is_zero_never_nan(self, value, eps):
        f = self.variant(whiten)
        x = jnp.full((2, 5), value, jnp.float32).at[1, 4].set(np.nan)
        m = np.ones((2, 5), bool)
        m[1, 4] = False
        assert np.all(np.asarray(f(x, jnp.asarray(m), eps)) == 0.0)  # all equal
        one = np.zeros((2, 5), bool)
        one[1, 2] = True
        assert np.all(np.asarray(f(x, jnp.asarray(one), eps)) == 0.0)  # a single token
        assert np.all(np.asarray(f(x, jnp.zeros((2, 5), bool), eps)) == 0.0)  # none

    @chex.variants(with_jit=True, without_jit=True)
    def test_explained_variance(self):
        ev = self.variant(explained_variance)
        y = jnp.asarray([[1.0, 2.0, np.nan], [3.0, 4.0, np.nan]])
        m = jnp.asarray([[1, 1, 0], [1, 1, 0]], jnp.float32)
        np.testing.assert_allclose(ev(y, y, m), 1.0)  # perfect critic
        np.testing.assert_allclose(ev(jnp.full_like(y, 2.5), y, m), 0.0, atol=1e-6)  # the mean return
        # residuals [0, 0, 0, 1]: population var 3/16; returns [1, 2, 3, 4]: population var 5/4
        v = jnp.asarray([[1.0, 2.0, 0.0], [3.0, 3.0, 0.0]])
        np.testing.assert_allclose(ev(v, y, m), 1 - (3 / 16) / (5 / 4), rtol=1e-6)
        assert np.isnan(ev(v, jnp.full_like(y, 0.1), m))  # constant returns: undefined
        assert np.isnan(ev(v, y, jnp.zeros_like(m)))  # no tokens


def test_ppo_bad_arguments_name_the_field():
    r, m = jnp.zeros((1, 3)), jnp.ones((1, 3))
    for gamma in (1.5, -0.1, float("nan"), "0.9", None, True):
        with pytest.raises(ValueError, match="gamma"):
            gae(r, r, m, gamma, 0.9)
    for lam in (1.01, -1.0, float("inf")):
        with pytest.raises(ValueError, match="lam"):
            gae(r, r, m, 0.9, lam)
    gae(r, r, m, 0, 1)  # the bounds themselves are fine
    with pytest.raises(ValueError, match="kl_coef"):
        token_rewards(jnp.zeros(1), m, r, -0.1)
    with pytest.raises(ValueError, match="eps"):
        whiten(r, m, -1.0)
