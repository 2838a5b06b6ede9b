"""The pieces of a policy loss that act on one unit (a token or a sequence): importance ratios, gates
and KL estimators. `gspo_jax.losses` assembles them, as its `LossConfig` chooses, into one loss.

  ratio  how π_θ/π_old is formed: per token, per sequence (GSPO), per sequence with per-token
         gradients (GSPO-token), as a geometric mean of log-clipped tokens (GMPO), or as the plain
         product of the token ratios, without GSPO's 1/|o| (VESPO's W), per sequence or with
         per-token gradients
  gate   what turns (ratio, advantage) into a loss: the PPO clip, CISPO's clipped stop-gradient
         weight, SAPO's soft sigmoid gate, or VESPO's gamma kernel

Everything here is a pure function of float32 log-probabilities and bool masks (the caller casts).
Shape letters: see `gspo_jax/__init__.py`. Formulas: docs/ALGORITHMS.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

Array = jax.Array


class GateSettings(Protocol):
    """What the gates read of a loss's settings (`losses.LossConfig` has them all)."""

    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    log_ratio_clamp: float
    sapo_tau_pos: float
    sapo_tau_neg: float
    vespo_k_pos: float
    vespo_k_neg: float
    vespo_lambda_pos: float
    vespo_lambda_neg: float


# VESPO's floor on log W (TRL and the paper's code clamp W at 1e-8): φ there is ~e^λ·1e-8^k, i.e. 0.
VESPO_LOG_W_MIN = math.log(1e-8)


# ----------------------------------------------------------------------------------------------
# KL estimators.


def kl_k1(d: Array) -> Array:
    """k1 = -d, with d = ref_logp - logp (unbiased, high variance, can be negative)."""
    return -d


def kl_k2(d: Array) -> Array:
    """k2 = d²/2 (biased, low variance, non-negative)."""
    return 0.5 * jnp.square(d)


def kl_k3(d: Array) -> Array:
    """k3 = exp(d) - d - 1 (unbiased, low variance, non-negative); d is clamped by the caller."""
    return jnp.expm1(d) - d


KL_FNS: dict[str, Callable[[Array], Array]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


# ----------------------------------------------------------------------------------------------
# Log-ratios.


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
    """Σ of x where mask is set (0 elsewhere, whatever x holds there), over `axis` (None: all)."""
    return jnp.sum(jnp.where(mask, x, 0.0), axis=axis)


def masked_log_ratio(logp_BT: Array, old_logp_BT: Array, mask_BT: Array) -> Array:
    """Δ = logp - old_logp, exactly 0 off the mask (whatever is stored there). Not clamped: each
    ratio clamps the quantity it exponentiates (a token's Δ, or a sequence's mean Δ)."""
    return jnp.where(mask_BT, logp_BT - old_logp_BT, 0.0)


def clamp_log_ratio(x: Array, clamp: float) -> Array:
    """x clamped to ±clamp: gradient 1 inside (boundary included), 0 outside."""
    return jnp.where(jnp.abs(x) <= clamp, x, jnp.clip(jax.lax.stop_gradient(x), -clamp, clamp))


def _mean_delta(delta_BT: Array, mask_BT: Array) -> Array:
    return masked_sum(delta_BT, mask_BT, axis=-1) / jnp.maximum(jnp.sum(mask_BT, axis=-1), 1.0)


def sequence_log_ratio(delta_BT: Array, mask_BT: Array, clamp: float) -> Array:
    """log s_i = Σ_t m Δ / max(1, Σ_t m): GSPO's length-normalised sequence log-ratio, [B]."""
    return clamp_log_ratio(_mean_delta(delta_BT, mask_BT), clamp)


def _with_token_gradients(log_s_B: Array, live_BT: Array, logp_BT: Array) -> Array:
    """sg[log s_i] + logp_t - sg[logp_t]: the value of a sequence's log-ratio at each of its tokens, the
    gradient of each live token's own logp (0 elsewhere), [B, T]."""
    safe_logp_BT = jnp.where(live_BT, logp_BT, 0.0)
    return jax.lax.stop_gradient(log_s_B)[:, None] + safe_logp_BT - jax.lax.stop_gradient(safe_logp_BT)


def sequence_token_log_ratio(delta_BT: Array, logp_BT: Array, mask_BT: Array, clamp: float) -> Array:
    """log s_{i,t} = sg[log s_i] + logp_t - sg[logp_t]: value of s_i, gradient of each token alone.

    Where log s_i is clamped, the token gradients are cut too, as GSPO's are.
    """
    mean_B = _mean_delta(delta_BT, mask_BT)
    inside_B1 = (jnp.abs(mean_B) <= clamp)[:, None]
    return _with_token_gradients(clamp_log_ratio(mean_B, clamp), mask_BT & inside_B1, logp_BT)


def _sum_clamped_delta(delta_BT: Array, mask_BT: Array, clamp: float) -> Array:
    return masked_sum(clamp_log_ratio(delta_BT, clamp), mask_BT, axis=-1)


def sequence_sum_log_ratio(delta_BT: Array, mask_BT: Array, clamp: float) -> Array:
    """log W_i = clamp(Σ_t m clamp(Δ_t)): the log of the product of the token ratios, [B].

    GSPO's sequence ratio without its 1/|o| (VESPO's W, and the ablation VESPO's critique asks for);
    each token's Δ is clamped as a token ratio's is, then the sum, as TRL's `vespo` loss does.
    """
    return clamp_log_ratio(_sum_clamped_delta(delta_BT, mask_BT, clamp), clamp)


def sequence_sum_token_log_ratio(delta_BT: Array, logp_BT: Array, mask_BT: Array, clamp: float) -> Array:
    """log W_{i,t} = sg[log W_i] + logp_t - sg[logp_t]: value of W_i, gradient of each token alone.

    A token passes no gradient where log W_i, or its own Δ, is clamped (as in `sequence_sum`).
    """
    sum_B = _sum_clamped_delta(delta_BT, mask_BT, clamp)
    live_BT = mask_BT & (jnp.abs(delta_BT) <= clamp) & (jnp.abs(sum_B) <= clamp)[:, None]
    return _with_token_gradients(clamp_log_ratio(sum_B, clamp), live_BT, logp_BT)


class ClippedLogRatio(NamedTuple):
    log_ratio: Array  # per sequence [B]
    low_BT: Array  # token clipped at the low side (bool)
    high_BT: Array


def geometric_log_ratio(
    delta_BT: Array, mask_BT: Array, adv_B: Array, eps_low: float, eps_high: float, clamp: float
) -> ClippedLogRatio:
    """GMPO: clip each token's Δ in log space on the side sign(A) selects, then masked mean.

    For A > 0 only Δ > eps_high is clipped, for A < 0 only Δ < -eps_low; a clipped token passes no
    gradient.
    """
    pos_B1, neg_B1 = (adv_B > 0)[:, None], (adv_B < 0)[:, None]
    high_BT = pos_B1 & (delta_BT > eps_high) & mask_BT
    low_BT = neg_B1 & (delta_BT < -eps_low) & mask_BT
    clipped_BT = jnp.where(high_BT, eps_high, jnp.where(low_BT, -eps_low, delta_BT))
    return ClippedLogRatio(clamp_log_ratio(_mean_delta(clipped_BT, mask_BT), clamp), low_BT, high_BT)


# ----------------------------------------------------------------------------------------------
# Gates: (log-ratio x, advantage A) -> per-unit loss and which units were clipped. A "unit" is a
# token ([B, T] inputs) or a sequence ([B] inputs); the gates are shape-agnostic.


class Gated(NamedTuple):
    loss: Array
    low: Array  # clipped at the low side (A < 0, x < 1 - eps_low), bool
    high: Array  # clipped at the high side (A > 0, x > 1 + eps_high), bool
    dual: Array  # capped by the dual clip (A < 0, x > c), bool
    weight: Array  # gradient weight relative to the plain policy gradient A·∇logp, for diagnostics


def clip_gate(cfg: GateSettings, log_x: Array, adv: Array, logp: Array | None = None) -> Gated:
    """PPO clip ℓ = -min(x·A, clip(x)·A), written as a select so a clipped unit's gradient is 0.

    With dual clip, for A < 0 the loss is further capped at -c·A (also zero gradient there).
    """
    del logp
    x = jnp.exp(log_x)
    high = (adv > 0) & (x > 1.0 + cfg.eps_high)
    low = (adv < 0) & (x < 1.0 - cfg.eps_low)
    bound = jnp.where(high, 1.0 + cfg.eps_high, 1.0 - cfg.eps_low)
    loss = jnp.where(high | low, -jax.lax.stop_gradient(bound) * adv, -x * adv)
    dual = jnp.zeros_like(high)
    if cfg.dual_clip_c is not None:
        dual = (adv < 0) & (x > cfg.dual_clip_c)
        loss = jnp.where(dual, -cfg.dual_clip_c * adv, loss)
    weight = jnp.where(high | low | dual, 0.0, jax.lax.stop_gradient(x))
    return Gated(loss, low, high, dual, weight)


def cispo_gate(cfg: GateSettings, log_x: Array, adv: Array, logp: Array | None = None) -> Gated:
    """CISPO: ℓ = -sg(clip(r, 1-eps_low, 1+eps_high))·A·logp; every token keeps its gradient."""
    x = jnp.exp(log_x)
    high, low = x > 1.0 + cfg.eps_high, x < 1.0 - cfg.eps_low
    w = jax.lax.stop_gradient(jnp.clip(x, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high))
    return Gated(-w * adv * logp, low, high, jnp.zeros_like(high), w)


def sapo_gate(cfg: GateSettings, log_x: Array, adv: Array, logp: Array | None = None) -> Gated:
    """SAPO soft gate: ℓ = -A·(4/τ)·σ(τ(x - 1)), τ = τ_pos if A > 0 else τ_neg.

    Its gradient is A·4σ(1-σ)·x·∇log x, equal to the policy gradient at x = 1 and decaying smoothly
    away from it; nothing is hard-clipped, so the clip fractions stay 0.
    """
    del logp
    x = jnp.exp(log_x)
    tau = jnp.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    sig = jax.nn.sigmoid(tau * (x - 1.0))
    no = jnp.zeros(x.shape, bool)
    weight = jax.lax.stop_gradient(4.0 * sig * (1.0 - sig) * x)
    return Gated(-adv * (4.0 / tau) * sig, no, no, no, weight)


def vespo_gate(cfg: GateSettings, log_x: Array, adv: Array, logp: Array | None = None) -> Gated:
    """VESPO: ℓ = -sg(φ(x))·A·logp with the gamma kernel φ(x) = x^k·e^{λ(1-x)}, k, λ by sign(A) (A >= 0: pos).

    φ(1) = 1 and φ is largest at x = k/λ, then decays as e^{-λx}: a smooth, asymmetric reshaping of the
    sequence weight instead of a clip. Only φ's value is used (REINFORCE-style, like CISPO), computed in
    log space with log x clamped to [log 1e-8, log_ratio_clamp] as TRL does; nothing is hard-clipped.
    """
    log_w = jnp.clip(jax.lax.stop_gradient(log_x), VESPO_LOG_W_MIN, cfg.log_ratio_clamp)
    pos = adv >= 0
    k = jnp.where(pos, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = jnp.where(pos, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    no = jnp.zeros(phi.shape, bool)
    return Gated(-phi * adv * logp, no, no, no, phi)


GATE_FNS: dict[str, Callable[..., Gated]] = {
    "clip": clip_gate,
    "cispo": cispo_gate,
    "sapo": sapo_gate,
    "vespo": vespo_gate,
}
