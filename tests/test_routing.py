"""Drift metrics against hand-counted routings."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.routing import (
    expert_load,
    flipped_tokens,
    log_ratio_decomposition,
    overlap,
    router_margin,
    routing_diagnostics,
    routing_drift,
)


class TestRoutingDrift(chex.TestCase):
    """Each test runs twice: with `routing_drift` as is and under `jax.jit` (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_counted_drift(self):
        # 2 layers, 1 sequence of 3 tokens (the last is padding), top-2 of 4 experts
        # written layer by layer, then made batch-first [B, L, T, K]
        old = np.array([[[[0, 1], [2, 3], [0, 2]]], [[[1, 3], [0, 1], [3, 2]]]], np.int32).transpose(1, 0, 2, 3)
        new = np.array([[[[1, 0], [2, 0], [1, 3]]], [[[1, 3], [3, 2], [0, 1]]]], np.int32).transpose(1, 0, 2, 3)
        valid = np.array([[True, True, False]])
        m = self.variant(routing_drift)(jnp.asarray(old), jnp.asarray(new), jnp.asarray(valid))
        # overlaps on valid tokens: layer 0: 2 (same set, other order), 1; layer 1: 2, 0
        assert float(m["slot_change_rate"]) == pytest.approx(1 - (2 + 1 + 2 + 0) / (2 * 2 * 2))
        assert float(m["router_flip_rate"]) == pytest.approx(2 / 4)
        np.testing.assert_allclose(m["flip_rate_per_layer"], [0.5, 0.5])
        assert float(m["token_any_flip"]) == pytest.approx(1 / 2)  # token 0 never flips, token 1 flips in both
        assert float(m["flips_per_token"]) == pytest.approx(1.0)
        assert float(m["jaccard"]) == pytest.approx((1 + 1 / 3 + 1 + 0) / 4)

    @chex.variants(with_jit=True, without_jit=True)
    def test_identical_routings_have_no_drift(self):
        rng = np.random.default_rng(0)
        topk = jnp.asarray(np.stack([rng.permutation(8)[:2] for _ in range(3 * 4 * 5)]).reshape(4, 3, 5, 2))
        logits = jnp.asarray(rng.normal(size=(4, 3, 5, 8)), jnp.float32)
        m = self.variant(routing_drift)(topk, topk, jnp.ones((4, 5), bool), logits, logits)
        assert float(m["slot_change_rate"]) == 0 and float(m["router_flip_rate"]) == 0
        assert float(m["jaccard"]) == 1 and abs(float(m["router_kl"])) < 1e-6 and float(m["router_tv"]) == 0

    @chex.variants(with_jit=True, without_jit=True)
    def test_router_kl_and_tv_match_numpy(self):
        rng = np.random.default_rng(1)
        a, b = rng.normal(size=(1, 2, 3, 4)), rng.normal(size=(1, 2, 3, 4))
        topk = jnp.zeros((1, 2, 3, 1), jnp.int32)
        m = self.variant(routing_drift)(topk, topk, jnp.ones((1, 3), bool), jnp.asarray(a), jnp.asarray(b))
        pa, pb = np.exp(a) / np.exp(a).sum(-1, keepdims=True), np.exp(b) / np.exp(b).sum(-1, keepdims=True)
        assert float(m["router_kl"]) == pytest.approx(np.mean(np.sum(pa * np.log(pa / pb), -1)), rel=1e-5)
        assert float(m["router_tv"]) == pytest.approx(np.mean(0.5 * np.abs(pa - pb).sum(-1)), rel=1e-5)


def test_overlap_ignores_order():
    assert int(overlap(jnp.array([3, 1, 2]), jnp.array([2, 3, 0]))) == 2


class TestLogRatioDecomposition(chex.TestCase):
    """Runs with `log_ratio_decomposition` as is and under `jax.jit` (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_log_ratio_decomposition_parts_add_up(self):
        own = jnp.array([[0.0, -1.0, -2.0]])
        rep = jnp.array([[0.0, -1.5, -2.0]])
        old = jnp.array([[0.1, -1.5, -1.0]])
        m = self.variant(log_ratio_decomposition)(own, rep, old, jnp.array([[1, 1, 0]]))
        assert float(m["logratio_routing_abs"]) == pytest.approx(0.25)
        assert float(m["logratio_rest_abs"]) == pytest.approx(0.05)
        assert float(m["logratio_routing_share"]) == pytest.approx(0.25 / ((0.01 + 0.25) / 2) / 2)


class TestRoutingDiagnostics(chex.TestCase):
    """Router margin, entropy, expert load and the flip rate by margin bucket, against hand values."""

    def test_flipped_tokens_are_those_whose_set_changed_in_any_layer(self):
        old = np.array([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]], np.int32)  # [B=1, L=2, T=2, K=2]
        new = old.copy()
        new[0, 1, 1] = [7, 6]  # same set, other order: not a flip
        assert not np.asarray(flipped_tokens(jnp.asarray(old), jnp.asarray(new))).any()
        new[0, 1, 0] = [4, 2]  # token 0 changes in layer 1 only
        np.testing.assert_array_equal(flipped_tokens(jnp.asarray(old), jnp.asarray(new)), [[True, False]])

    def test_margin_is_the_gap_between_the_kth_and_the_next_probability(self):
        probs = jnp.asarray([[[[0.5, 0.05, 0.3, 0.15]]]], jnp.float32)
        np.testing.assert_allclose(router_margin(probs, 1), [[[0.2]]], rtol=1e-6)
        np.testing.assert_allclose(router_margin(probs, 2), [[[0.15]]], rtol=1e-6)
        np.testing.assert_allclose(router_margin(probs, 3), [[[0.1]]], rtol=1e-6)

    def test_expert_load_counts_assignments_on_valid_tokens(self):
        topk = jnp.asarray([[[[0, 1], [0, 2], [3, 3]]]], jnp.int32)  # the last token is padding
        load = expert_load(topk, jnp.asarray([[True, True, False]]), 4)
        np.testing.assert_allclose(load, [[0.5, 0.25, 0.25, 0.0]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_built_diagnostics(self):
        # 1 layer, 4 experts, top-1, three valid tokens and one padding token
        probs = np.array(
            [[0.7, 0.1, 0.1, 0.1], [0.27, 0.25, 0.25, 0.23], [0.4, 0.35, 0.15, 0.1], [0.25, 0.25, 0.25, 0.25]],
            np.float32,
        )
        logits = jnp.asarray(np.log(probs)[None, None])  # [1, 1, 4, 4]
        new = jnp.asarray(np.array([0, 0, 0, 0], np.int32)[None, None, :, None])
        old = jnp.asarray(np.array([0, 1, 0, 2], np.int32)[None, None, :, None])  # token 1 flipped
        valid = jnp.asarray([[True, True, True, False]])
        d = self.variant(routing_diagnostics)(old, new, logits, valid)
        margins = [0.6, 0.02, 0.05]  # buckets (edges .01 .03 .1 .3): 4, 1, 2
        assert float(d["router_margin"]) == pytest.approx(np.mean(margins), rel=1e-5)
        entropy = -np.sum(probs[:3] * np.log(probs[:3]), axis=-1)
        assert float(d["router_entropy"]) == pytest.approx(entropy.mean(), rel=1e-5)
        np.testing.assert_allclose(d["margin_bucket_frac"], [0, 1 / 3, 1 / 3, 0, 1 / 3], atol=1e-7)
        np.testing.assert_allclose(d["flip_rate_by_margin"], [0, 1, 0, 0, 0], atol=1e-7)
        np.testing.assert_allclose(d["load_old"], [[2 / 3, 1 / 3, 0, 0]], rtol=1e-6)
        np.testing.assert_allclose(d["load_new"], [[1, 0, 0, 0]])
        np.testing.assert_allclose(d["load_max_per_layer"], [4.0])
        np.testing.assert_allclose(d["load_moved_per_layer"], [1 / 3], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_unchanged_routing_moves_nothing_and_uniform_routers_have_maximal_entropy(self):
        rng = np.random.default_rng(1)
        topk = jnp.asarray(np.stack([rng.permutation(8)[:2] for _ in range(2 * 3 * 5)]).reshape(2, 3, 5, 2))
        d = self.variant(routing_diagnostics)(topk, topk, jnp.zeros((2, 3, 5, 8)), jnp.ones((2, 5), bool))
        assert float(np.max(d["flip_rate_by_margin"])) == 0 and float(np.max(d["load_moved_per_layer"])) == 0
        assert float(d["router_entropy"]) == pytest.approx(np.log(8), rel=1e-6)
        assert float(np.sum(d["margin_bucket_frac"])) == pytest.approx(1.0)
        np.testing.assert_allclose(np.sum(d["load_new"], axis=-1), 1.0, rtol=1e-6)
