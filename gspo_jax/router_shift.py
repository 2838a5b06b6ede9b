"""RSPO's router-shift ratio: how far the router moved on the experts π_old activated, per token.

Router-Shift Policy Optimization (Zhang et al., 2025, arXiv 2510.23027, "Towards Stable and Effective
Reinforcement Learning for Mixture-of-Experts") rescales each token's importance ratio by
γ̃ = sg[max(exp(−Δ), γ_min)], where Δ is the mean over MoE layers and over π_old's K experts of
|log r_θ(e) − log r_old(e)|, r the router's softmax probability. The rescaled ratio then goes through
the objective's clipping and aggregation (`losses.policy_loss(weights=LossWeights(router_shift=...))`).
Formula and choices: "Router-shift ratio (RSPO)" in docs/ALGORITHMS.md.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gspo_jax.metrics import Mean, Metric, Min

Array = jax.Array
# Which router probabilities γ compares: the full softmax at π_old's experts (the paper's r, mass moving
# to experts outside the set counts), or those renormalised over π_old's K experts (the gates some
# reimplementations read: only the shares within the set count).
PROBS = ("softmax", "topk")


def expert_logprobs(router_logits_BLTE: Array, topk_BLTK: Array) -> Array:
    """log r(e | ·) = log softmax(router logits)[e] at the experts `topk`, float32 [B, L, T, K]: the
    router's (full-softmax, before any top-k renormalisation) log-probability of each chosen expert."""
    logr_BLTE = jax.nn.log_softmax(router_logits_BLTE.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logr_BLTE, topk_BLTK.astype(jnp.int32), axis=-1)


class RouterShift(NamedTuple):
    """RSPO's per-token weight and its diagnostics."""

    weight_BT: Array  # γ̃ = sg[max(γ, γ_min)], float32 [B, T]; 1 where nothing moved (and with L = 0)
    metrics: dict[str, Metric]


def renormalised(logr_BLTK: Array) -> Array:
    """Log-probabilities at K experts renormalised over those K: log r(e_k) − log Σ_j r(e_j)."""
    return logr_BLTK - jax.nn.logsumexp(logr_BLTK, axis=-1, keepdims=True)


def shift_weight(
    new_logr_BLTK: Array, old_logr_BLTK: Array, mask_BT: Array, floor: float, probs: str = "softmax"
) -> RouterShift:
    """γ = exp(−(1/L) Σ_l (1/K) Σ_k |log r_θ(e_k) − log r_old(e_k)|) over π_old's experts e_k, floored
    at `floor` and stop-gradient (a sample weight, never a path into the router).

    Both arguments are router log-probabilities at the same experts, π_old's (`expert_logprobs`), of the
    full softmax; with `probs` "topk" each is renormalised over those K first (`PROBS`).
    Metrics over the `mask_BT` tokens: `router_shift_mean` / `_min` (γ̃ as applied),
    `router_shift_raw_mean` (γ before the floor), `router_shift_floor_frac` (tokens with γ < γ_min,
    whose weight is the floor) and `router_shift_deviation_mean` (Δ, nats).
    """
    if probs not in PROBS:
        raise ValueError(f"shift_weight: probs must be one of {PROBS}, not {probs!r}")
    sg = jax.lax.stop_gradient
    new_BLTK, old_BLTK = (sg(x).astype(jnp.float32) for x in (new_logr_BLTK, old_logr_BLTK))
    if probs == "topk":
        new_BLTK, old_BLTK = renormalised(new_BLTK), renormalised(old_BLTK)
    diff_BLTK = jnp.abs(new_BLTK - old_BLTK)
    _, L, _, _ = diff_BLTK.shape
    dev_BT = jnp.mean(jnp.mean(diff_BLTK, axis=-1), axis=1) if L else jnp.zeros(mask_BT.shape, jnp.float32)
    gamma_BT = jnp.exp(-dev_BT)  # Δ ≥ 0: no overflow, no clamp needed
    weight_BT = jnp.maximum(gamma_BT, jnp.float32(floor))
    m = jnp.asarray(mask_BT) > 0
    n = jnp.sum(m).astype(jnp.float32)
    total = lambda x: jnp.sum(jnp.where(m, x, 0.0))
    metrics = {
        "router_shift_mean": Mean(total(weight_BT), n, 1.0),
        "router_shift_min": Min(jnp.min(jnp.where(m, weight_BT, jnp.inf)), n, 1.0),
        "router_shift_raw_mean": Mean(total(gamma_BT), n, 1.0),
        "router_shift_floor_frac": Mean(total((gamma_BT < floor).astype(jnp.float32)), n),
        "router_shift_deviation_mean": Mean(total(dev_BT), n),
    }
    return RouterShift(weight_BT, metrics)
