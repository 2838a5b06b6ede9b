"""Sampler–trainer mismatch metrics: identities and hand-computed values, jitted and eager."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.mismatch import mismatch_metrics

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
