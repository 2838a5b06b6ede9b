"""Group advantages, the dynamic-sampling filter and overlong shaping, against hand-computed values."""

import functools

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo_jax.advantages import group_advantages, informative_groups, overlong_penalty
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
        assert {a.advantage_scale for name, a in ALGORITHMS.items() if name != "dr_grpo"} == {"group"}

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
